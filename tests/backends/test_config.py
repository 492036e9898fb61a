"""One typed config: ``init_backends``'s dict is parsed into dataclasses, with one unknown-key
check that names the section, the unknown key and the valid choices, the same way everywhere."""

import re

import pytest

from forge_obs.controller.config import LoggerConfig


@pytest.mark.parametrize(
    "config, section, valid",
    [
        ({"console": {"compat": True}}, "console backend", "compact"),
        ({"tensorboard": {"logdir": "x"}}, "tensorboard backend", "log_dir"),
        ({"jsonl": {"fsync_interval": 5}}, "jsonl backend", "fsync_interval_s"),
        ({"wandb": {"mode": "offline", "projct": "p"}}, "wandb backend", "any wandb.init argument"),
        ({"run": {"dir": "x"}}, "run", "id, root"),
        ({"timeline": {"rank": "0"}}, "timeline", "ranks"),
        ({"alerts": {"sink": "console"}}, "alerts", "sinks"),
    ],
)
def test_an_unknown_key_names_its_section_and_the_valid_keys(tmp_path, config, section, valid):
    from forge_obs.backends.base import get_logger_backend_class

    with pytest.raises(ValueError) as info:
        cfg = LoggerConfig.parse({**config, "run": config.get("run", {"root": str(tmp_path)})})
        for name, bcfg in cfg.backends.items():  # what init_backends does next
            get_logger_backend_class(name)(bcfg)
    msg = str(info.value)
    assert re.match(rf"{re.escape(section)}: unknown key\(s\) \['\w+'\]; valid: ", msg), msg
    assert valid in msg


def test_backend_options_are_dataclasses_with_their_defaults():
    from forge_obs.backends.console import ConsoleBackend, ConsoleOptions

    be = ConsoleBackend({"every": 5, "include": "trainer/"})
    assert isinstance(be.options, ConsoleOptions) and be.options.every == 5 and be.options.include == ["trainer/"]
    assert be.options.width == 120 and be.options.stream == "stdout"
    with pytest.raises(ValueError, match="every=0 must be an integer >= 1"):
        ConsoleBackend({"every": 0})


def test_backend_init_timeout_is_a_reserved_key_of_seconds(tmp_path):
    run = {"root": str(tmp_path)}
    assert LoggerConfig.parse({"run": run}).backend_init_timeout_s == 120.0
    cfg = LoggerConfig.parse({"run": run, "backend_init_timeout_s": 5})
    assert cfg.backend_init_timeout_s == 5.0 and sorted(cfg.backends) == ["jsonl"]
    for bad in (0, -1, "5", True, float("inf")):
        with pytest.raises(ValueError, match="backend_init_timeout_s must be a number of seconds > 0"):
            LoggerConfig.parse({"run": run, "backend_init_timeout_s": bad})
