"""One checkpointer per engine: how a strategy's trained state is written into a checkpoint folder and
read back. What is the same for every format (the folder's name, manifest, atomic rename, retention,
finding the latest or good one, RNG states) lives in store.py.

  Checkpointer            one process or DDP: rank 0 writes the trained weights (safetensors) and the
                          optimizer's state; in the background if asked
  DcpCheckpointer         FSDP: every rank writes its shards through torch.distributed.checkpoint
                          (`async_save` in the background), which any world size can load
  DeepSpeedCheckpointer   ZeRO: DeepSpeed's own files; at another process count (or into one process)
                          through DeepSpeed's universal-checkpoint conversion

A background save: a writer thread on rank 0 first copies the trained weights and optimizer state to
host memory while training computes its next forward and backward (`staged()`, called before each
optimizer step, waits for that copy), then writes, fsyncs, hashes, adds the manifest last and renames;
under FSDP every rank hands its shards to DCP's `async_save` (its own gloo group, so that its
collectives never meet training's), and rank 0's writer waits for DCP to finish (all ranks' files
written and synced) before the rest. One save is in flight at a time; `wait()` blocks on it (the next
save, a rollback, preemption and the end of the run call it), so a kill mid-write leaves a folder
without a manifest that resuming skips.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from finetune.checkpoint.store import (
    DEEPSPEED,
    SHARDED,
    WEIGHTS,
    checkpoint_root,
    complete,
    find_good,
    host_copy,
    rng_state,
    set_rng_state,
    step_dir,
    trainable_state,
)
from finetune.config.schema import CONFIG_FILE

TRAINER_STATE = "trainer_state.json"
RANK_STATE = "state-rank{}.safetensors"  # save()'s rank_state, one file a rank


class Checkpointer:
    """One process or DDP: the trained weights and the optimizer's state as whole files."""

    layout = "full"

    def __init__(self, model, optimizer, scheduler, accelerator):
        self.model, self.optimizer, self.scheduler, self.accelerator = model, optimizer, scheduler, accelerator
        self._writer: threading.Thread | None = None  # the background save in flight (rank 0)
        self._staged = threading.Event()  # set while no background save still needs the live weights and optimizer state
        self._staged.set()
        self._errors: list[BaseException] = []
        self._shards = None  # DCP's future for this rank's shards of the save in flight
        self.after_file = None  # called with the step after each file rank 0 writes (the recipe hands it the tests' faults)
        self.rank_state: dict[str, torch.Tensor] = {}  # what `save`'s rank_state was in the checkpoint last restored (this rank's)

    # -- saving

    def save(self, output_dir: str | Path, progress: dict, config_yaml: str, keep_last: int, background: bool = False,
             rank_state: dict[str, torch.Tensor] | None = None) -> Path | None:
        """Write the checkpoint of the run's `progress` (resume.Progress.state_dict(): its step, ...).
        Every rank calls this; rank 0 writes all but the RNG files, `rank_state` (tensors of this rank's,
        such as GRPO's held rollouts) and the shards each rank writes itself. `background`: every rank
        returns once its state is copied, and rank 0's writer thread completes the checkpoint."""
        self.wait()
        step = progress["step"]
        accelerator = self.accelerator
        root = checkpoint_root(output_dir)
        tmp = root / f".{step_dir(root, step).name}.tmp"
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
        if rank_state:
            save_file(rank_state, tmp / RANK_STATE.format(accelerator.process_index))
        shards = self._write_shards(tmp, background)
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            self._shards = shards  # wait() joins it
            return None
        state = {**progress, "world_size": accelerator.num_processes}
        files = {"scheduler.pt": self.scheduler.state_dict(), CONFIG_FILE: config_yaml, **self._whole_files(state)}
        if getattr(accelerator, "scaler", None) is not None:  # fp16 on a GPU: the dynamic loss scale
            files["scaler.pt"] = accelerator.scaler.state_dict()
        files[TRAINER_STATE] = json.dumps(state)
        if not background:
            return complete(tmp, root, step, files, keep_last, self.after_file)
        live = {name: files.pop(name) for name in (WEIGHTS, "optimizer.pt") if name in files}  # the writer copies these
        self._staged.clear()
        self._writer = threading.Thread(target=self._complete_or_record, args=(shards, tmp, root, step, host_copy(files), live, keep_last),
                                        name="checkpoint-writer")
        self._writer.start()
        return step_dir(root, step)

    def _write_shards(self, tmp: Path, background: bool):
        """What each rank writes itself; returns the future of a background write."""
        return None

    def _whole_files(self, state: dict) -> dict:
        """Rank 0's files of the trained state (and what `state` records about them)."""
        model = bare(self.model)
        # torch numbers the optimizer's parameters; their names let a ZeRO run at any count resume from it
        names = {id(p): n for n, p in model.named_parameters()}
        state["optimizer_params"] = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        return {WEIGHTS: trainable_state(model), "optimizer.pt": self.optimizer.state_dict()}

    def _complete_or_record(self, shards, tmp: Path, root: Path, step: int, files: dict, live: dict, keep_last: int) -> None:
        try:
            try:
                files = {**files, **host_copy(live)}
            finally:
                self._staged.set()
            if shards is not None:
                shards.result()  # DCP's metadata is written once every rank's files are: they are all there
            complete(tmp, root, step, files, keep_last, self.after_file)
        except BaseException as err:  # raised in the training thread at its next wait()
            self._errors.append(err)

    def wait(self) -> None:
        """Block until the background save in flight, if any, is complete; raise what made it fail."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._shards is not None:
            future, self._shards = self._shards, None
            try:
                future.result()
            except BaseException as err:  # rank 0's writer records the same failure; other ranks learn it here
                self._errors.append(err)
        if self._errors:
            err = self._errors.pop()
            raise RuntimeError(f"the background checkpoint save failed: {err}") from err

    def staged(self) -> float:
        """Block until the background save in flight holds its own copy of what an optimizer step
        changes in place; the seconds waited."""
        began = time.perf_counter()
        self._staged.wait()
        return time.perf_counter() - began

    # -- restoring

    def restore(self, path: Path, scratch: Path) -> dict:
        """Load a checkpoint into the run; returns the progress it recorded. `scratch`: the resuming run's
        folder, where a conversion may be written (and removed after)."""
        written = json.loads((path / TRAINER_STATE).read_text())
        if (path / SHARDED).is_dir():
            self._restore_dcp(path)
        elif (path / DEEPSPEED).is_dir():
            self._restore_deepspeed(path, written, scratch)
        else:
            self._restore_whole(path, written)
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        if (path / "scaler.pt").exists() and getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
        rng_file = path / f"rng-rank{self.accelerator.process_index}.pt"
        if rng_file.exists():  # absent when resuming at a larger world size: that rank starts fresh
            set_rng_state(torch.load(rng_file, weights_only=True))
        self.rank_state = {}
        state_file = path / RANK_STATE.format(self.accelerator.process_index)
        # this rank's share of the work at the saved world size only (GRPO: its prompts' rollouts; another size samples anew)
        if state_file.exists() and written.get("world_size") == self.accelerator.num_processes:
            self.rank_state = load_file(state_file)
        return written

    def _restore_whole(self, path: Path, written: dict) -> None:
        copy_trainable(load_file(path / WEIGHTS), bare(self.model), path)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))

    def _restore_dcp(self, path: Path) -> None:
        """DCP reshards: its checkpoints load into a run of any world size, sharded or not."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        stepped = _saved_optimizer(path / SHARDED)
        state = _sharded_state(self.model, self.optimizer, with_optimizer=stepped)
        try:
            dcp.load(state, checkpoint_id=path / SHARDED)
        except Exception as err:  # DCP names the first key it cannot match
            raise ValueError(f"{path}: its weights do not match this model's trainable parameters ({str(err).splitlines()[0][:200]})") from None
        options = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen weights come from the base
        if stepped:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
        else:  # the start (a rollback to step 0): the optimizer as it was before any step
            set_model_state_dict(self.model, state["model"], options=options)
            self.optimizer.state.clear()

    def _restore_deepspeed(self, path: Path, written: dict, scratch: Path) -> None:
        """A ZeRO checkpoint into one process or DDP, through DeepSpeed's universal form."""
        with universal(path, scratch, self.accelerator) as folder:
            _restore_universal(folder / "state" / "zero", bare(self.model), self.optimizer, written["step"], path)


class DcpCheckpointer(Checkpointer):
    """FSDP: each rank's shards through torch.distributed.checkpoint."""

    layout = "dcp"

    def __init__(self, *args):
        super().__init__(*args)
        self._group = None  # the gloo group DCP's background collectives use, made at the first background save

    def _write_shards(self, tmp: Path, background: bool):
        import torch.distributed.checkpoint as dcp

        state = _sharded_state(self.model, self.optimizer, with_optimizer=bool(self.optimizer.state))
        if not background:
            dcp.save(state, checkpoint_id=tmp / SHARDED)
            return None
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # by every rank at once
        return dcp.async_save(state, checkpoint_id=tmp / SHARDED, process_group=self._group)

    def _whole_files(self, state: dict) -> dict:
        return {}

    def _restore_whole(self, path: Path, written: dict) -> None:
        raise ValueError(f"{path} was written by an unsharded run; resume it with distributed.strategy: ddp or zero2/zero3 (or start afresh)")

    def _restore_deepspeed(self, path: Path, written: dict, scratch: Path) -> None:
        raise ValueError(f"{path} was written by DeepSpeed ZeRO with {written['world_size']} processes; resume it with a "
                         "zero strategy (any process count) or in one process")


class DeepSpeedCheckpointer(Checkpointer):
    """ZeRO: DeepSpeed writes its own files (synchronously), every rank its partitions."""

    layout = "deepspeed"

    def _write_shards(self, tmp: Path, background: bool):
        self.model.save_checkpoint(tmp / DEEPSPEED, tag="state", save_latest=False, exclude_frozen_parameters=True)
        return None

    def _whole_files(self, state: dict) -> dict:
        return {}

    def _restore_dcp(self, path: Path) -> None:
        raise ValueError(f"{path} was written by an FSDP run; resume it with distributed.strategy: fsdp (any process count)")

    def _restore_deepspeed(self, path: Path, written: dict, scratch: Path) -> None:
        # DeepSpeed unpickles its own files (torch.load weights_only=False): only ever files this
        # package wrote, whose checksums verify() has just matched against the manifest.
        model = self.model
        if written["world_size"] == self.accelerator.num_processes:
            model.load_checkpoint(path / DEEPSPEED, tag="state", load_module_strict=False, load_lr_scheduler_states=False)
            return
        with universal(path, scratch, self.accelerator) as folder:
            # DeepSpeed reads a universal checkpoint where its config says so; set for this one load.
            model._config.load_universal_checkpoint = True
            try:
                model.load_checkpoint(folder, tag="state", load_module_strict=False, load_lr_scheduler_states=False)
            finally:
                model._config.load_universal_checkpoint = False

    def _restore_whole(self, path: Path, written: dict) -> None:
        """An unsharded run's checkpoint into a ZeRO engine: every rank reads the whole trained state
        and keeps its partition, through DeepSpeed's documented routes (GatheredParameters for the
        weights the forward uses, safe_set_full_* for the fp32 master copy and the optimizer's states)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        names = written.get("optimizer_params")
        if names is None:
            raise ValueError(f"{path} was written by one process before checkpoints named the optimizer's parameters; resume it in one process")
        params = {n: p for n, p in self.model.module.named_parameters() if p.requires_grad}
        check_trainable(names, params, path)
        weights, saved = load_file(path / WEIGHTS), torch.load(path / "optimizer.pt", weights_only=True)
        states = [saved["state"].get(i, {}) for group in saved["param_groups"] for i in group["params"]]
        _create_zero_optimizer_states(self.optimizer, next((state for state in states if state), {}))
        for name, state in zip(names, states):
            param = params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(weights[name])
            safe_set_full_fp32_param(param, weights[name])
            for key, value in state.items():
                if key != "step":
                    safe_set_full_optimizer_state(param, value, key)


def bare(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's wrapper, as accelerate's unwrap_model gives it, without the DeepSpeed import that
    unwrap_model makes wherever DeepSpeed is installed (about a second of every process's start: docs/platform-notes.md).
    A DeepSpeed engine unwraps itself (`.module`); FSDP2 and per-layer compilation leave the top module as it is."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _sharded_state(model, optimizer, with_optimizer: bool = True) -> dict:
    """Trainable weights and optimizer state keyed by parameter name, as this rank holds them.

    Before the first step the optimizer holds no state, and there is none to save: torch's get_state_dict
    would make one by a step at LR 0 (its _init_optim_state), which Adam counts as its first, so the run's
    first real update would be taken as a second one, smaller by Adam's bias correction (an FSDP run then
    parted from the same run in one process at step 2: 6.344 against 6.315)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    if not with_optimizer:
        return {"model": get_model_state_dict(model, options=options)}
    weights, optim = get_state_dict(model, optimizer, options=options)
    return {"model": weights, "optimizer": optim}


def _saved_optimizer(folder: Path) -> bool:
    """Whether a DCP checkpoint holds optimizer state (one written before the first step does not)."""
    import torch.distributed.checkpoint as dcp

    return any(key.startswith("optimizer") for key in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@contextlib.contextmanager
def universal(path: Path, scratch: Path, accelerator):
    """DeepSpeed's universal form of the ZeRO checkpoint at `path` (its ds_to_universal: one folder
    per parameter with its fp32 value and optimizer states, whole), converted once by the main process
    into a folder of ours under `scratch`, removed after the load."""
    folder = Path(scratch) / f".universal-{path.name}"
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
        convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path / DEEPSPEED / "state"),
                   "--output_folder", str(folder / "state"), "--num_extract_workers", "1", "--num_merge_workers", "1",
                   "--inject_missing_state"]  # ZeRO-2 files lack a version record that only Megatron writes (in memory: the files stay as they are)
        done = subprocess.run(convert, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"{path}: DeepSpeed's universal-checkpoint conversion failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        (folder / "latest_universal").write_text("state")
    accelerator.wait_for_everyone()
    try:
        yield folder
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def _restore_universal(zero: Path, model, optimizer, step: int, path: Path) -> None:
    """A universal checkpoint's trained weights and optimizer states into an unsharded model and its
    torch optimizer. Its files hold each parameter flattened, one file per state (exp_avg, ...)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    check_trainable({d.name for d in zero.iterdir() if d.is_dir()}, params, path)
    state = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    with torch.no_grad():
        for name, param in params.items():
            files = {f.stem: _universal_tensor(f).view(param.shape) for f in (zero / name).glob("*.pt") if f.stem != "step"}
            param.copy_(files.pop("fp32"))
            # Adam's step is the run's: ZeRO steps the optimizer at every step (DeepSpeed applies even a skipped one).
            state["state"][index[id(param)]] = {**files, "step": torch.tensor(float(step))}
    optimizer.load_state_dict(state)


def _universal_tensor(file: Path) -> torch.Tensor:
    value = torch.load(file, weights_only=True)
    return value["param"] if isinstance(value, dict) else value  # ZeRO-2's conversion wraps each tensor in a dict


def _create_zero_optimizer_states(optimizer, example: dict) -> None:
    """DeepSpeed's torch optimizer creates its states at the first step; create them now, zero, with
    the saved step count, so that safe_set_full_optimizer_state has somewhere to write. Its optimizer
    steps flat fp32 partitions: ZeRO-3 keeps them in fp32_partitioned_groups_flat, ZeRO-2 in
    single_partition_of_fp32_groups (what DeepSpeed's own universal loader writes to)."""
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    cpu_adam = type(optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"  # counts its steps in a Python int
    for flat in flats:
        state = optimizer.optimizer.state[flat]
        for key, value in example.items():
            if key == "step":
                state[key] = int(value) if cpu_adam else value.clone().to(flat.device)
            else:
                state.setdefault(key, torch.zeros_like(flat))
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-2 links each parameter's fragment of them after its first step
        optimizer._lazy_init_hp_params_optimizer_state()


def check_trainable(saved, params: dict, path: Path) -> None:
    """The names a checkpoint holds against the model's trainable parameters: the same set, or one line."""
    differ = sorted(set(saved) ^ set(params))
    if differ:
        raise ValueError(f"{path}: its weights do not match this model's trainable parameters (e.g. {differ[0]})")


def copy_trainable(weights: dict[str, torch.Tensor], model, path: Path) -> None:
    params = dict(model.named_parameters())
    check_trainable(weights, {n: p for n, p in params.items() if p.requires_grad}, path)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def load_trainable(path: Path, model) -> None:
    """Only the trained weights of a checkpoint of any layout, into an unsharded model in this
    process (finetune merge / generate on a checkpoint mid-run)."""
    if (path / SHARDED).is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))}
        dcp.load(state, checkpoint_id=path / SHARDED)  # reads only these keys: no optimizer state
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    elif (path / DEEPSPEED).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # Unpickles DeepSpeed's own files: callers verify() the manifest first, as restore does.
        weights = get_fp32_state_dict_from_zero_checkpoint(path / DEEPSPEED, tag="state", exclude_frozen_parameters=True)
        copy_trainable(weights, model, path)
    else:
        copy_trainable(load_file(path / WEIGHTS), model, path)


def last_good(out: Path, best_step: int, evaluate, model) -> dict:
    """Where the final weights are not the best seen: the newest good checkpoint from before the best
    level, and (unsharded runs with eval data) its eval loss, the final weights put back after."""
    path = find_good(out, best_step)
    result = {"last_good_checkpoint": str(path) if path else None, "last_good_eval_loss": None}
    if path is None or evaluate is None:
        return result
    final = host_copy(trainable_state(model))  # a copy: loading the checkpoint overwrites the parameters
    load_trainable(path, model)
    result["last_good_eval_loss"] = evaluate()["eval_loss"]
    model.load_state_dict(final, strict=False)
    return result
