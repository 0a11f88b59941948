"""One Strategy value: what each strategy does, and every module asking it instead of a list of names."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, base_config

from finetune.config.schema import validate_config
from finetune.config.strategy import NAMES, Strategy
from finetune.outputs.plan import setup_from_config
from finetune.parallel.engines import FSDP, Engine, Zero, engine_class

EXPECTED = {  # name: (replicated, shards states, shards weights, ZeRO stage, offload, layout)
    "none": (True, False, False, None, False, "full"),
    "ddp": (True, False, False, None, False, "full"),
    "fsdp": (False, True, True, None, False, "dcp"),
    "zero2": (False, True, False, 2, False, "deepspeed"),
    "zero3": (False, True, True, 3, False, "deepspeed"),
    "zero3_offload": (False, True, True, 3, True, "deepspeed"),
}


@pytest.mark.parametrize("name", NAMES)
def test_each_strategy_says_what_it_does_and_one_process_is_none(name):
    s = Strategy.of(name, world=2)
    assert (s.replicated, s.shards_states, s.shards_weights, s.zero_stage, s.offload, s.layout) == EXPECTED[name]
    assert Strategy.of(name, world=1) == Strategy.of("none") and Strategy.of(name).name == name


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_and_the_planner_run_the_same_strategy(name, tmp_path, tiny_model_dir):
    cfg = validate_config(base_config(tiny_model_dir, tmp_path / "out", distributed={"strategy": name}), "test")
    for world in (1, 2):
        cls, strategy = engine_class(cfg, world)
        assert strategy == Strategy.of(name, world)
        assert cls is {"full": Engine, "dcp": FSDP, "deepspeed": Zero}[strategy.layout]
        setup = setup_from_config(cfg, world)
        assert setup.strategy == strategy.name and (setup.shards_states, setup.shards_weights) == (strategy.shards_states, strategy.shards_weights)


def test_an_unknown_strategy_is_one_line():
    with pytest.raises(ValueError, match="expected one of none, ddp, fsdp, zero2, zero3, zero3_offload"):
        Strategy.of("zero4")


def test_the_strategy_module_imports_no_torch():
    """The planner and `validate` ask it before anything heavy is imported."""
    code = "import sys, finetune.config.strategy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
