#!/usr/bin/env bash
# One node's share of a multi-node run: torchrun with a c10d rendezvous. Run it on every node.
set -euo pipefail
source "$(dirname "$0")/common.sh"

usage() {
    cat <<USAGE
usage: launch/multi_node.sh [options] [--dry-run] -- TRAIN_ARGS...

Run the same command on every node. The nodes meet at a c10d rendezvous (host:port, job id) and
torchrun's elastic agent restarts all workers when one fails (--max-restarts). CPU-only nodes use
gloo, GPU nodes nccl; the script sets what accelerate needs on a CPU.

Elastic (--nnodes MIN:MAX): when a node is lost the others start again at the smaller size from the
newest checkpoint, with the same global batch (train.grad_accum re-derived); a node that comes back
(the same command started on it) is taken in: the running processes save, stop and start again at
the larger size. The rendezvous host must stay up (it holds the rendezvous). docs/running.md.

  --nnodes N|MIN:MAX      nodes in the job, or an elastic range    (env NNODES, default 1)
  --nproc-per-node N      processes per node (default: GPU count, or 1 on a CPU-only node)
  --rdzv-host HOST        rendezvous host, usually the first node  (env MASTER_ADDR, default 127.0.0.1)
  --rdzv-port PORT        rendezvous port                          (env MASTER_PORT, default 29500)
  --rdzv-id ID            same on every node of one job            (env RDZV_ID, default finetune)
  --max-restarts N        restarts after a worker fails, a lost node included
                          (env MAX_RESTARTS, default 0; 100 with an elastic range)
  --rdzv-conf K=V,...     torchrun's rendezvous settings, e.g. last_call_timeout=10 (seconds
                          the rendezvous waits for more nodes once MIN are there; default 30)
  --dry-run               print the command, run nothing

example (on each of two nodes):
  launch/multi_node.sh --nnodes 2 --rdzv-host node0 --rdzv-id run42 -- --config configs/lora.yaml
USAGE
}

nnodes="${NNODES:-1}" nper="" host="${MASTER_ADDR:-127.0.0.1}" port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-finetune}" restarts="${MAX_RESTARTS:-}" rdzv_conf=""
while [ $# -gt 0 ]; do
    case "$1" in
        --nnodes) nnodes="$2"; shift 2 ;;
        --nproc-per-node) nper="$2"; shift 2 ;;
        --rdzv-host) host="$2"; shift 2 ;;
        --rdzv-port) port="$2"; shift 2 ;;
        --rdzv-id) rdzv_id="$2"; shift 2 ;;
        --max-restarts) restarts="$2"; shift 2 ;;
        --rdzv-conf) rdzv_conf="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "launch/multi_node.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "launch/multi_node.sh: no training arguments (e.g. -- --config configs/lora.yaml)" >&2; exit 2; }

# A fixed-size job launched again while its first launch still runs would fail at the rendezvous with a
# stack trace; `finetune validate` says first, in one line, which run holds the output folder (and
# anything else train would refuse). An elastic range (MIN:MAX) lets nodes join a running job: no check.
case "$nnodes" in
    *:*) export FINETUNE_ELASTIC="$nnodes"; restarts="${restarts:-100}" ;;
    *) [ "${DRY_RUN:-0}" = "1" ] || PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m finetune validate "$@" > /dev/null ;;
esac
# Each start of the workers gets a fresh store of its own (hosted by its rank 0) instead of the agent's,
# where a start after a node joined would find the earlier start's addresses under the same keys.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

gpus="$(gpu_count)"
nper="${nper:-$([ "$gpus" = "0" ] && echo 1 || echo "$gpus")}"
setup_cpu_if_needed "$nper"
run_or_print "$PYTHON" -m torch.distributed.run --nnodes "$nnodes" --nproc_per_node "$nper" \
    --rdzv_backend c10d --rdzv_endpoint "$host:$port" --rdzv_id "$rdzv_id" --max_restarts "${restarts:-0}" \
    ${rdzv_conf:+--rdzv_conf "$rdzv_conf"} \
    "$REPO/finetune/train.py" "$@"
