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
  --local-addr ADDR       this node's address on the network the nodes share (env LOCAL_ADDR;
                          default: the address this node reaches the rendezvous host from)
  --iface NAME            the interface of that network: its address, and gloo's and NCCL's
                          sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) (env IFACE)
  --connect-timeout S     seconds to wait for the rendezvous host, and a worker for rank 0's
                          store, before stopping in one line (env CONNECT_TIMEOUT, default 120)
  --agent-grace S         seconds torchrun's agent may run on once a worker has ended with its
                          code (a hung step, watchdog.min_seconds) and no restarted worker has
                          taken over, before it is stopped; a node cut off from the rendezvous host
                          otherwise waits on it for many minutes (env AGENT_GRACE; default 60 for a
                          fixed size, 0 (never stopped) with an elastic range or --max-restarts
                          unless given: there it must exceed the rendezvous' time to re-form)
  --dry-run               print the command, run nothing

Addresses: where the hostname resolves to loopback (containers, many cloud images) or to another
network than the nodes share, torchrun alone would hang. Before it starts, this script takes the
address the kernel routes to the rendezvous host from (or --local-addr / --iface), passes it to
torchrun (--local-addr), lets the node whose address is the rendezvous host's host the store
(is_host), and checks that the rendezvous host answers from there: a wrong or unreachable address
ends in one line naming the node and the setting, exit 2. A rendezvous host on loopback (one
machine) keeps torchrun's own choices.

example (on each of two nodes):
  launch/multi_node.sh --nnodes 2 --rdzv-host node0 --rdzv-id run42 -- --config configs/lora.yaml
USAGE
}

nnodes="${NNODES:-1}" nper="" host="${MASTER_ADDR:-127.0.0.1}" port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-finetune}" restarts="${MAX_RESTARTS:-}" rdzv_conf=""
local_addr="${LOCAL_ADDR:-}" iface="${IFACE:-}" connect_timeout="${CONNECT_TIMEOUT:-120}" agent_grace="${AGENT_GRACE:-60}" grace_given="${AGENT_GRACE:+1}"
while [ $# -gt 0 ]; do
    case "$1" in
        --nnodes) nnodes="$2"; shift 2 ;;
        --nproc-per-node) nper="$2"; shift 2 ;;
        --rdzv-host) host="$2"; shift 2 ;;
        --rdzv-port) port="$2"; shift 2 ;;
        --rdzv-id) rdzv_id="$2"; shift 2 ;;
        --max-restarts) restarts="$2"; shift 2 ;;
        --rdzv-conf) rdzv_conf="$2"; shift 2 ;;
        --local-addr) local_addr="$2"; shift 2 ;;
        --iface) iface="$2"; shift 2 ;;
        --connect-timeout) connect_timeout="$2"; shift 2 ;;
        --agent-grace) agent_grace="$2"; grace_given=1; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "launch/multi_node.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "launch/multi_node.sh: no training arguments (e.g. -- --config configs/lora.yaml)" >&2; exit 2; }

# This node's address, interface and store role, checked before anything waits (finetune/parallel/network.py).
check=(--rdzv-host "$host" --rdzv-port "$port" --nnodes "$nnodes" --connect-timeout "$connect_timeout" ${local_addr:+--local-addr "$local_addr"} ${iface:+--iface "$iface"})
if [ "${DRY_RUN:-0}" = "1" ]; then  # the command as any node starts it: each adds its own address when it runs
    LOCAL_ADDR="" IFACE="" IS_HOST=""
    echo "launch: dry run: each node takes its address for the rendezvous ($host) when it runs" >&2
else
    chosen="$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m finetune.parallel.network "${check[@]}")" || exit 2
    eval "$chosen"  # LOCAL_ADDR, IFACE, IS_HOST
fi
if [ -n "$IFACE" ]; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$IFACE}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$IFACE}"
fi
if [ -n "$IS_HOST" ] && [[ ",$rdzv_conf," != *",is_host="* ]]; then
    rdzv_conf="${rdzv_conf:+$rdzv_conf,}is_host=$IS_HOST"
fi
export FINETUNE_CONNECT_TIMEOUT="$connect_timeout"  # the workers' wait for rank 0's store

# A fixed-size job launched again while its first launch still runs would fail at the rendezvous with a
# stack trace; `finetune validate` says first, in one line, which run holds the output folder (and
# anything else train would refuse). An elastic range (MIN:MAX) lets nodes join a running job: no check.
export AGENT_GRACE="$agent_grace"
case "$nnodes" in
    *:*) export FINETUNE_ELASTIC="$nnodes"; restarts="${restarts:-100}" ;;
    *) [ "${DRY_RUN:-0}" = "1" ] || PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m finetune validate "$@" > /dev/null ;;
esac
# The agent starts the workers again after a failure, after re-forming the rendezvous: a grace only where asked for
[ "${restarts:-0}" = "0" ] || [ -n "$grace_given" ] || export AGENT_GRACE=0
# Each start of the workers gets a fresh store of its own (hosted by its rank 0) instead of the agent's,
# where a start after a node joined would find the earlier start's addresses under the same keys.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1


gpus="$(gpu_count)"
nper="${nper:-$([ "$gpus" = "0" ] && echo 1 || echo "$gpus")}"
setup_cpu_if_needed "$nper"
run_or_print "$PYTHON" -m torch.distributed.run --nnodes "$nnodes" --nproc_per_node "$nper" \
    --rdzv_backend c10d --rdzv_endpoint "$host:$port" --rdzv_id "$rdzv_id" --max_restarts "${restarts:-0}" \
    ${LOCAL_ADDR:+--local_addr "$LOCAL_ADDR"} ${rdzv_conf:+--rdzv_conf "$rdzv_conf"} \
    "$REPO/finetune/train.py" "$@"
