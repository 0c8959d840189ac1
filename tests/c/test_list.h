/*
 * Every test, once.  TEST_ENTRY(name, timeout_s, flags).
 * flags: 0, or TEST_XFAIL for a test that documents a known core bug (it
 * must fail; if it passes, the runner reports it as a failure so the mark is
 * removed), or TEST_HIDDEN for the runner's own self-checks, which run only
 * when named on the command line.
 */
#define TEST_LIST(X)                                                          \
    X(status_names, 10, 0)                                                    \
    X(table_empty, 10, 0)                                                     \
    X(table_many_keys, 20, 0)                                                 \
    X(table_replace, 10, 0)                                                   \
    X(table_extreme_keys, 10, 0)                                              \
    X(table_wraparound_cluster, 10, 0)                                        \
    X(table_random_vs_reference, 60, 0)                                       \
    X(table_iterate_and_remove, 30, 0)                                        \
    X(registry_first_cause_wins, 10, 0)                                       \
    X(registry_peek_pop_drop, 10, 0)                                          \
    X(registry_many_rooms, 20, 0)                                             \
    X(registry_failure_fill, 10, 0)                                           \
    X(registry_concurrent_record, 60, 0)                                      \
    X(registry_concurrent_mixed, 60, 0)                                       \
    X(wire_round_trip_all_types, 10, 0)                                       \
    X(wire_golden_bytes, 10, 0)                                               \
    X(wire_every_truncation_rejected, 60, 0)                                  \
    X(wire_trailing_bytes_rejected, 10, 0)                                    \
    X(wire_room_req_prefix, 10, 0)                                    \
    X(wire_bs_dp_pp, 10, 0)                                                   \
    X(wire_hello_fields, 10, 0)                                       \
    X(wire_bad_header, 10, 0)                                                 \
    X(wire_failure_code_zero, 10, 0)                                          \
    X(wire_limits, 30, 0)                                                     \
    X(wire_encoder_edges, 10, 0)                                              \
    X(wire_constructors, 10, 0)                                               \
    X(wire_array_readers, 10, 0)                                              \
    X(wire_type_names, 10, 0)                                                 \
    X(am_header_round_trip, 10, 0)                                            \
    X(auth_seal_open_round_trip, 10, 0)                                       \
    X(auth_every_bit_flip_rejected, 30, 0)                                    \
    X(auth_other_key_and_unsealed, 10, 0)                                     \
    X(auth_replay_window, 10, 0)                                              \
    X(auth_many_senders_bounded, 60, 0)                                       \
    X(am_header_rejects, 10, 0)                                               \
    X(room_new_defaults, 10, 0)                                               \
    X(room_advance_forward_only, 10, 0)                                       \
    X(room_terminal_is_final, 10, 0)                                          \
    X(room_fail_settle, 10, 0)                                                \
    X(room_force_drain, 10, 0)                                                \
    X(room_complete, 10, 0)                                                   \
    X(room_random_walk, 30, 0)                                                \
    X(room_run_length, 10, 0)                                                 \
    X(room_pages_check, 10, 0)                                                \
    X(plan_long_run_alone, 10, 0)                                             \
    X(plan_coalesce_and_cut, 10, 0)                                           \
    X(plan_merge_buffers, 10, 0)                                              \
    X(plan_resume_and_aux, 10, 0)                                             \
    X(plan_state_rows, 10, 0)                                                 \
    X(stateslice_moves_every_byte_once, 20, 0)                                \
    X(stateslice_pieces_joined_and_replicated, 10, 0)                         \
    X(stateslice_bad_rules, 10, 0)                                            \
    X(stateslice_compat_names_both_sides, 10, 0)                              \
    X(plan_hold_retries_same, 10, 0)                                          \
    X(plan_random_cover, 60, 0)                                               \
    X(plan_heads_links, 10, 0)                                                \
    X(plan_heads_bad, 10, 0)                                                  \
    X(plan_heads_rows, 10, 0)                                                 \
    X(room_claim_once, 10, 0)                                                 \
    X(room_ops_succeed_abandon, 10, 0)                                        \
    X(heap_empty_and_order, 10, 0)                                            \
    X(heap_update_moves_both_ways, 10, 0)                                     \
    X(heap_random_vs_model, 60, 0)                                            \
    X(peer_state_transitions, 10, 0)                                          \
    X(log_utf8_trim, 10, 0)                                                   \
    X(registry_early_bounded, 10, 0)                                          \
    X(hist_bounds_tables, 10, 0)                                              \
    X(hist_observe_edges, 10, 0)                                              \
    X(hist_random_vs_reference, 30, 0)                                        \
    X(log_basic, 10, 0)                                                       \
    X(log_truncation, 10, 0)                                                  \
    X(log_min_level, 10, 0)                                                   \
    X(log_overflow_dropped, 10, 0)                                            \
    X(log_read_timeout, 10, 0)                                                \
    X(log_close_semantics, 10, 0)                                             \
    X(log_close_wakes_reader, 10, 0)                                          \
    X(log_concurrent_writers_reader, 60, 0)                                   \
    X(log_read_negative_timeout, 1, 0)                                        \
    X(log_write_shared, 10, 0)                                                \
    X(ucxaddr_real_address_accepted, 10, 0)                                   \
    X(ucxaddr_every_truncation_refused, 10, 0)                                \
    X(ucxaddr_overreads_refused, 10, 0)                                       \
    X(ucxaddr_impossible_values_refused, 10, 0)                               \
    X(ucxaddr_own_transport_lengths_required, 10, 0)                          \
    X(pagecopy_matches_memcpy, 20, 0)                                         \
    X(_selftest_assert, 5, TEST_HIDDEN)                                       \
    X(_selftest_crash, 5, TEST_HIDDEN)                                        \
    X(_selftest_hang, 1, TEST_HIDDEN)
