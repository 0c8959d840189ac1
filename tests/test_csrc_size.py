"""The C core's size rules (scripts/csrc_size.py): no file over 1000 lines,
no function over 150."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("csrc_size", ROOT / "scripts" / "csrc_size.py")
csrc_size = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(csrc_size)


def test_core_within_size_rules():
    assert csrc_size.breaches(ROOT) == []


def test_checker_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join("    x++;" for _ in range(160))
    src = f"static int kvr_long(int x)\n{{\n{body}\n    return x;\n}}\n"
    src += "int kvr_short(void)\n{\n    return 0;\n}\n" + "/* pad */\n" * 900
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "big.c").write_text(src)
    found = csrc_size.breaches(tmp_path)
    assert found == [
        "csrc/big.c: 1068 lines (more than 1000)",
        "csrc/big.c:1: kvr_long has 164 lines (more than 150)",
    ]
    assert [f[0] for f in csrc_size.functions(tmp_path / "csrc" / "big.c")] == ["kvr_long", "kvr_short"]
