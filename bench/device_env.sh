# Source on the H200 device machine (Python 3.12, CUDA torch preinstalled, no PyPI):
#   source bench/device_env.sh
# Installs the pinned grpcio/protobuf wheels carried in .whl/ and rota's packages into
# /tmp/site (non-editable, offline), keeps NVLink multicast off, and puts `rota` on PATH.
# .whl/ is git-ignored; fill it here first (pass carry=[".whl"] to the device run):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     grpcio==1.71.2 grpcio-health-checking==1.71.2 protobuf==6.31.1 megatron-core==0.16.1
# (protobuf 6.31.1, not 5.x: the device's tensorboard, which megatron-core imports, needs >= 6.31.1)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c 'import grpc, google.protobuf as p, torch; print("device has grpcio", grpc.__version__, "protobuf", p.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
pkgs="packages/core packages/adapter-fsdp"
[ -d packages/adapter-megatron ] && pkgs="$pkgs packages/adapter-megatron"  # needs megatron-core's wheel in .whl/
[ -d packages/agent ] && pkgs="$pkgs packages/agent"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site $pkgs
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
