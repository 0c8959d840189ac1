#!/usr/bin/env bash
# Installs sglang 0.5.23 for tests/test_sglang_real.py: sglang without its
# dependencies, then only what its disaggregation, scheduler-queue and KV-pool
# modules import, torch 2.14.1 with the CUDA libraries it links against (it
# runs on the CPU; there is no CPU-only torch 2.14.1 on the package index).
# Skips whatever is already installed at the pinned version; never touches
# numpy or pytest.
set -euo pipefail
PY=${PYTHON:-python3}
PINS=(
  sglang==0.5.23 torch==2.14.1
  nvidia-cublas==13.1.1.3 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
  nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
  nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 nvidia-cudnn-cu13==9.24.0.43
  nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 nvidia-nvshmem-cu13==3.4.5
  psutil==7.2.2 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 anyio==4.16.0
  msgspec==0.23.0 pyzmq==27.3.0 tqdm==4.70.1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
  transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2
  filelock==4.3.2 truststore==0.10.5 h11==0.16.0 safetensors==0.8.0 tokenizers==0.23.3
  regex==2026.5.9 torchvision==0.29.1 dill==0.4.1 apache-tvm-ffi==0.1.15.post2
  sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
  openai==3.60.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2 fsspec==2026.9.0 pillow==13.0.0
  requests
)
missing=()
for pin in "${PINS[@]}"; do
  name=${pin%%==*}
  want=${pin#*==}
  have=$($PY -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")
  if [ -z "$have" ] || { [ "$want" != "$pin" ] && [ "$have" != "$want" ]; }; then
    missing+=("$pin")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup_sglang: installing ${#missing[@]} package(s): ${missing[*]}"
  $PY -m pip install -q --no-deps "${missing[@]}"
fi
$PY -c "import torch, sglang.srt.disaggregation.decode, sglang.srt.disaggregation.prefill, sglang.srt.plugins" 2>/dev/null \
  || { echo "setup_sglang: sglang 0.5.23 does not import" >&2; exit 1; }
echo "setup_sglang: sglang $($PY -c 'import sglang.version as v; print(v.__version__)') ready"
