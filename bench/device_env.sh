# Source on the H200 device machine (Python 3.12, CUDA torch preinstalled, no PyPI):
#   source bench/device_env.sh
#   ROTA_ENV_ONLY=1 source bench/device_env.sh   # a later call on the same warm machine: exports only
# Installs the pinned grpcio/protobuf wheels carried in .whl/ and rota's packages into
# /tmp/site (non-editable, offline), keeps NVLink multicast off, and puts `rota` on PATH.
# .whl/ is git-ignored; fill it here first (pass carry=[".whl"] to the device run):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     grpcio==1.71.2 grpcio-health-checking==1.71.2 protobuf==6.31.1 megatron-core==0.16.1 nvidia-ml-py \
#     tinker==0.38.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 \
#     anyio==4.16.0 sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1 distro==1.9.0 pydantic==2.14.4 \
#     pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
#     orjson==3.13.0 zstandard==0.25.0 rich==15.0.0 Pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
#     click==8.5.1 tqdm==4.70.1 pluggy==1.7.0 PyJWT==2.10.1 prometheus-client==0.26.0 uvicorn==0.54.0 \
#     liger-kernel==0.8.5
# (the tinker SDK and its dependencies serve bench/tinker_density.py; nvidia-ml-py the agent's NVML readings;
# liger-kernel bench/liger_kernels.py, with the device's triton)
# (protobuf 6.31.1, not 5.x: the device's tensorboard, which megatron-core imports, needs >= 6.31.1)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# the device's protobuf is newer than our generated code: harmless, but one warning per process and file
export PYTHONWARNINGS="ignore::UserWarning:google.protobuf.runtime_version"
python3 -c 'import grpc, google.protobuf as p, torch; print("device has grpcio", grpc.__version__, "protobuf", p.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())'
python3 -c 'import transformers, peft, safetensors, tokenizers as t; print("device has transformers", transformers.__version__, "peft", peft.__version__, "tokenizers", t.__version__)' || true
# what is installed is named by a hash of the packages' sources and the wheels: the same tree is never installed
# twice on a warm machine (a reinstall costs up to a minute of device time, and one inside a queued step once
# raced the device tool's copy of the tree: "build/bdist...: No such file")
tree=$( (find packages \( -path '*/src/*' -type f ! -name '*.pyc' ! -path '*.egg-info/*' \) -o -name pyproject.toml
         ls .whl/*.whl 2>/dev/null) | LC_ALL=C sort \
        | xargs sha256sum 2>/dev/null | sha256sum | cut -c1-16)
if [ "${ROTA_ENV_ONLY:-}" = 1 ] && [ -d /tmp/site/rota ]; then
  # a later call on the same warm machine (a queue may be running): the exports only, nothing reinstalled
  echo "device_env: /tmp/site kept as installed (ROTA_ENV_ONLY=1)"
elif [ -d /tmp/site/rota ] && [ "$(cat /tmp/site/.rota-tree 2>/dev/null)" = "$tree" ]; then
  echo "device_env: /tmp/site already holds this tree ($tree): nothing reinstalled"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # every package the GPU benches import (no dependencies resolved: the device has torch, transformers and peft)
  pkgs=""
  for p in core torch adapter-fsdp adapter-megatron serving adapter-vllm adapter-sglang adapter-trl agent-client agent demo service-tinker; do
    [ -d packages/$p ] && pkgs="$pkgs packages/$p"
  done
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site $pkgs \
    && echo "$tree" > /tmp/site/.rota-tree
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # keeps a staged engine (stage_wheels.py env) on the path
