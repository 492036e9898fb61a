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


# ------------------------------------------------------------------ what init_backends checks
SK = "sk-proj-abcdefghijklmnop0401XYZ"
GHP = "ghp_abcdefghijklmnopqrstuv0402"


def _init_backends_checks(config):
    """What ``init_backends`` does with a config before any backend starts: parse it, then create
    every backend (the Monarch controller and the SPMD logger rank both call these two)."""
    from forge_obs.controller.startup import create_backends

    return create_backends(LoggerConfig.parse(config).backends)


def _error_text(config) -> str:
    """The error a config mistake raises, as a user's traceback shows it (every chained cause too)."""
    import traceback

    with pytest.raises((ValueError, TypeError)) as info:
        _init_backends_checks(config)
    return "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("config, says", [
    ({"console": {"logging_mode": SK}}, "logging_mode '***' is not a valid LoggingMode; valid: global_reduce"),
    ({"jsonl": {"logging_mode": ["global_reduce", GHP]}}, "logging_mode '***' is not a valid LoggingMode"),
    ({"jsonl": {GHP: 1}}, "jsonl backend: unknown key(s) ['***']; valid: logging_mode"),
    ({GHP: {}}, "Unknown logger backend type: '***'; valid: "),
    ({"aggregate": SK}, "aggregate must be one of 'auto', 'on', 'off', got '***'"),
    ({"flush_timeout_s": SK}, "flush_timeout_s must be a number of seconds > 0, got '***'"),
    ({"backend_queue_steps": SK}, "backend_queue_steps must be an int >= 1, got '***'"),
    ({"probe_round_trip": SK}, "probe_round_trip must be True or False, got '***'"),
    ({"console": {"stream": SK}}, "console backend: stream='***'; valid: stdout, stderr"),
    ({"jsonl": {"fsync_interval_s": SK}}, "jsonl backend: fsync_interval_s must be a number of seconds >= 0, got '***'"),
    ({"timeline": {"ranks": SK}}, "bad ranks '***'"),
    ({"alerts": {"sinks": [SK]}}, "alerts: unknown sink '***'; valid: console, file"),
    ({"alerts": {"webhook": f"ftp://hooks.example.com/x?token={SK}"}}, "alerts: webhook must be an http(s) URL"),
    ({"alerts": {"disable": [GHP]}}, "alerts: cannot disable unknown rule '***'; valid: "),
    ({"alerts": {"stall_s": SK}}, "alerts: stall_s must be a number, got '***'"),
    ({"run": {"id": f"{SK}/x"}}, "run id '***/x'"),
    ({"alerts": {"straggler_ratio": SK}}, "doctor setting straggler_ratio must be a float, got '***'"),
    ({"alerts": {"rules": [SK]}}, "bad alert rule '***': a rule is 'KEY OP NUMBER'"),
    ({"tensorboard": {"histograms": 5}}, "tensorboard backend: histograms must be a key prefix or a list of them"),
    ({"tensorboard": {"flush_secs": SK}}, "tensorboard backend: flush_secs must be a number of seconds > 0, got '***'"),
])
def test_a_config_mistake_names_the_valid_choices_and_never_quotes_a_secret(tmp_path, config, says):
    """The issue's ``logging_mode`` (an ``sk-…`` value echoed by init_backends' error) and every
    other message that quotes a user's value: the value goes through the one redaction rule, in
    the message and in every exception chained to it."""
    if "tensorboard" in config:
        pytest.importorskip("tensorboard")
    text = _error_text({"run": {"root": str(tmp_path)}, **config})
    assert SK not in text and GHP not in text and "0401XYZ" not in text and "uv0402" not in text
    assert says in text, text


@pytest.mark.parametrize("config, says", [
    ({"jsonl": {"filename": "../../x.jsonl"}}, "jsonl backend: filename '../../x.jsonl'"),
    ({"jsonl": {"filename": "/tmp/x.jsonl"}}, "jsonl backend: filename '/tmp/x.jsonl'"),
    ({"jsonl": {"filename": ""}}, "jsonl backend: filename ''"),
    ({"tensorboard": {"log_dir": "/tmp/tb"}}, "tensorboard backend: log_dir '/tmp/tb'"),
    ({"tensorboard": {"log_dir": "tb/../../tb"}}, "tensorboard backend: log_dir 'tb/../../tb'"),
    ({"wandb": {"mode": "offline", "dir": "/tmp"}}, "wandb backend: dir '/tmp'"),
    ({"wandb": {"mode": "offline", "dir": ".."}}, "wandb backend: dir '..'"),
    ({"alerts": {"file_name": "../alerts.jsonl"}}, "alerts: file_name '../alerts.jsonl'"),
    ({"alerts": {"file_name": "/var/tmp/alerts.jsonl"}}, "alerts: file_name '/var/tmp/alerts.jsonl'"),
])
def test_a_path_from_the_config_that_leaves_the_run_directory_is_rejected(tmp_path, config, says):
    """Every path that comes from configuration names a file or directory inside the run
    directory: an absolute path or a ``..`` raises at init_backends, naming the key and the rule."""
    if "tensorboard" in config:
        pytest.importorskip("tensorboard")
    if "wandb" in config:
        pytest.importorskip("wandb")
    text = _error_text({"run": {"root": str(tmp_path)}, **config})
    assert says in text and "must be a relative path inside the run directory" in text, text


@pytest.mark.parametrize("run, says", [
    ({"id": 5}, "run id must be a string, got int 5"),
    ({"id": ""}, "run id must not be empty"),
    ({"id": "a/b"}, "run id 'a/b'"),
    ({"id": ".."}, "run id '..'"),
    ({"id": "a\nb"}, "run id 'a\\nb'"),
    ({"id": " exp"}, "run id ' exp'"),
    ({"root": 5}, "run root must be a path (str or os.PathLike), got int 5"),
    ({"root": ""}, "run root must not be empty"),
])
def test_a_run_id_or_root_that_is_not_a_directory_name_is_rejected_with_the_rule(tmp_path, run, says):
    text = _error_text({"run": {"root": str(tmp_path), **run}})
    assert says in text, text
    if "id" in run and run["id"] != "":
        assert "one directory name: printable characters" in text


def test_the_run_id_from_the_environment_is_checked_the_same_way(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_OBS_RUN_ID", "../escape")
    with pytest.raises(ValueError, match=r"run id '\.\./escape' \(from FORGE_OBS_RUN_ID\)"):
        LoggerConfig.parse({"run": {"root": str(tmp_path)}})


def test_alert_rules_given_as_one_string_are_rejected_with_the_form_they_take(tmp_path):
    text = _error_text({"run": {"root": str(tmp_path)}, "alerts": {"rules": "trainer/loss > 10"}})
    assert "alerts: rules must be a list of rules, e.g. [\"trainer/loss > 10\"], got str" in text, text


def test_paths_inside_the_run_directory_are_taken(tmp_path):
    pytest.importorskip("tensorboard")
    backends = _init_backends_checks({"run": {"root": str(tmp_path)}, "jsonl": {"filename": "sub/m.jsonl"},
                                      "tensorboard": {"log_dir": "./boards"}, "alerts": {"file_name": "a/alerts.jsonl"}})
    assert backends["jsonl"].options.filename == "sub/m.jsonl"
    assert backends["tensorboard"].options.log_dir == "./boards"


@pytest.mark.parametrize("config, what", [
    ({"jsonl": {"filename": "out/metrics.jsonl"}}, "jsonl backend: filename 'out/metrics.jsonl'"),
    ({"tensorboard": {"log_dir": "out"}}, "tensorboard backend: log_dir 'out'"),
    ({"wandb": {"mode": "offline", "dir": "out"}}, "wandb backend: dir 'out'"),
    ({"alerts": {"file_name": "out/alerts.jsonl", "sinks": ["file"]}}, "alerts: file_name 'out/alerts.jsonl'"),
])
def test_a_path_that_leaves_the_run_directory_through_a_symlink_fails_its_backend_at_init(tmp_path, config, what):
    """A relative path whose directory is a symbolic link out of the run directory: the backend's
    ``init`` raises naming the key, nothing is written outside."""
    import asyncio

    from forge_obs.backends.record import RunContext
    from forge_obs.controller.startup import start_backends

    name = next(iter(config))
    if name in ("tensorboard", "wandb"):
        pytest.importorskip(name)
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "root" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "out").symlink_to(outside)
    backends = _init_backends_checks({"run": {"root": str(tmp_path / "root"), "id": "r"}, "jsonl": None, **config})
    with pytest.raises(RuntimeError) as info:
        asyncio.run(start_backends(backends, RunContext(run_id="r", run_dir=run_dir), 60.0))
    cause = str(info.value.__cause__)
    assert what in cause and "through a symbolic link" in cause, cause
    assert list(outside.iterdir()) == []
