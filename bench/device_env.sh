# Source on the H200 device machine (Python 3.12, CUDA torch preinstalled, no PyPI):
#   source bench/device_env.sh
# Installs the pinned grpcio/protobuf wheels carried in .whl/ and rota's packages into
# /tmp/site (non-editable, offline), keeps NVLink multicast off, and puts `rota` on PATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c 'import grpc, google.protobuf as p, torch; print("device has grpcio", grpc.__version__, "protobuf", p.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
pkgs="packages/core packages/adapter-fsdp"
[ -d packages/adapter-megatron ] && pkgs="$pkgs packages/adapter-megatron"  # needs megatron-core's wheel in .whl/
[ -d packages/agent ] && pkgs="$pkgs packages/agent"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site $pkgs
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
