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

# Runs the launcher and ends with the run's own exit code. torchrun reports any failed worker as its
# own exit 1; the workers leave their documented code (75 preempted, 3 diverged, 4 hung, 2 bad input)
# in FINETUNE_EXIT_FILE, and that is what this script exits with, so a scheduler can requeue on 75.
# Signals sent to this script (TERM, INT, USR1) go on to the launcher, which passes them to the workers.
# AGENT_GRACE (seconds; 0: off): once a worker has left its code, the launcher gets this long to end. A node
# cut off from the rendezvous host keeps torchrun's agent waiting on the host's store long after its workers
# ended (measured: over 400 s); past the grace it is stopped, and the script ends with the workers' code. A worker the
# agent starts again clears the file as it starts (errors.clear_recorded_exit): the grace counts from a code no restart followed.
run_or_print() {
    echo "launch: $*" >&2
    if [ "${DRY_RUN:-0}" = "1" ]; then return 0; fi
    FINETUNE_EXIT_FILE="$(mktemp "${TMPDIR:-/tmp}/finetune-exit.XXXXXX")"
    export FINETUNE_EXIT_FILE
    "$@" &
    local child=$! rc=0 grace="${AGENT_GRACE:-0}" waited=0
    trap 'kill -TERM "$child" 2>/dev/null' TERM INT
    trap 'kill -USR1 "$child" 2>/dev/null' USR1
    while kill -0 "$child" 2>/dev/null; do
        if [ ! -s "$FINETUNE_EXIT_FILE" ]; then
            waited=0  # no code, or a restarted worker cleared an earlier attempt's: the grace counts again from the next
        elif [ "$grace" != 0 ]; then
            waited=$((waited + 1))
            if [ "$waited" -gt "$grace" ]; then
                echo "launch: a worker ended with code $(head -n 1 "$FINETUNE_EXIT_FILE") and torchrun's agent had not ended $grace s later" \
                     "(the rendezvous host out of reach?); stopping it" >&2
                pkill -KILL -P "$child" 2>/dev/null; kill -KILL "$child" 2>/dev/null
                break
            fi
        fi
        sleep 1 & wait $! 2>/dev/null || true  # a signal to this script ends the sleep, not the loop (set -e)
    done
    rc=0
    wait "$child" 2>/dev/null || rc=$?
    if [ "$rc" != 0 ] && [ -s "$FINETUNE_EXIT_FILE" ]; then
        rc="$(head -n 1 "$FINETUNE_EXIT_FILE")"
    fi
    rm -f "$FINETUNE_EXIT_FILE" "$FINETUNE_EXIT_FILE".*  # and a half-written one of a rank killed while it wrote
    exit "$rc"
}
