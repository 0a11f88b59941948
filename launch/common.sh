# Shared by the launch scripts: pick the python, and set up CPU runs the way accelerate needs them.
# shellcheck shell=bash
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}"

gpu_count() {
    "$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
}

# Without a GPU, processes talk over gloo; accelerate needs ACCELERATE_USE_CPU to build a CPU
# process group, and each process gets an even share of the cores.
setup_cpu_if_needed() {
    local nproc="$1"
    if [ "$(gpu_count)" = "0" ]; then
        export ACCELERATE_USE_CPU=1
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))}"
        echo "launch: no GPU here: gloo backend, ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2
    fi
}

run_or_print() {
    echo "launch: $*" >&2
    if [ "${DRY_RUN:-0}" = "1" ]; then return 0; fi
    exec "$@"
}
