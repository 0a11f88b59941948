#!/usr/bin/env bash
# N training processes on this machine, any strategy the run config names.
set -euo pipefail
source "$(dirname "$0")/common.sh"

usage() {
    cat <<USAGE
usage: launch/single_node.sh [--nproc N] [--launcher torchrun|accelerate] [--dry-run] -- TRAIN_ARGS...

Starts N processes of finetune/train.py on this machine (default N: the GPU count, or 2 on a CPU-only
machine) through torchrun (default) or accelerate launch. TRAIN_ARGS go to the training script,
e.g. --config configs/lora.yaml --max-steps 100. Prints the exact command before running it.

  --nproc N         processes to start
  --launcher NAME   torchrun (default) or accelerate
  --port P          rendezvous port on localhost (default 29500)
  --dry-run         print the command, run nothing

example: launch/single_node.sh --nproc 2 -- --config configs/lora.yaml
USAGE
}

nproc_arg="" launcher=torchrun port=29500
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) nproc_arg="$2"; shift 2 ;;
        --launcher) launcher="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "launch/single_node.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "launch/single_node.sh: no training arguments (e.g. -- --config configs/lora.yaml)" >&2; exit 2; }

gpus="$(gpu_count)"
nprocs="${nproc_arg:-$([ "$gpus" = "0" ] && echo 2 || echo "$gpus")}"
setup_cpu_if_needed "$nprocs"
case "$launcher" in
    torchrun)
        run_or_print "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nprocs" \
            "$REPO/finetune/train.py" "$@" ;;
    accelerate)
        # --multi_gpu is accelerate's name for "several processes"; on a CPU, --cpu with 2 processes
        # would silently start one.
        multi=$([ "$nprocs" -gt 1 ] && echo --multi_gpu || echo "")
        run_or_print "$PYTHON" -m accelerate.commands.launch $multi --num_processes "$nprocs" --num_machines 1 \
            --main_process_port "$port" "$REPO/finetune/train.py" "$@" ;;
    *) echo "launch/single_node.sh: --launcher must be torchrun or accelerate" >&2; exit 2 ;;
esac
