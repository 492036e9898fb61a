"""The ``"alerts"`` entry of ``init_backends``: sinks, user rules, and any threshold of
:class:`~forge_obs.analysis.doctor.config.DoctorConfig` by name. Mistakes raise ``ValueError``
naming the valid choices (what they quote of the config redacted); ``file_name`` is a path inside
the run directory.

    >>> from forge_obs.alerts.config import AlertsConfig
    >>> cfg = AlertsConfig.from_dict({"sinks": ["console"], "rules": ["trainer/loss > 10"], "straggler_ratio": 2})
    >>> cfg.sinks, cfg.doctor.straggler_ratio, cfg.user_rules[0].text
    (['console'], 2.0, 'trainer/loss > 10')
    >>> AlertsConfig.from_dict({"sinks": ["slack"]})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: alerts: unknown sink 'slack'; valid: console, file, wandb, callback, webhook
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.rules import RULES
from forge_obs.analysis.doctor.user_rules import UserRule
from forge_obs.core.options import check_keys, redacted_errors
from forge_obs.core.redact import redacted_repr
from forge_obs.core.run import check_run_path

__all__ = ["SINKS", "RULE_NAMES", "AlertsConfig"]

SINKS = ("console", "file", "wandb", "callback", "webhook")
#: rule names ``disable`` accepts (``quiet_rank`` goes with ``missing_ranks``)
RULE_NAMES = (*RULES, "slowdown", "stall")


@dataclass
class AlertsConfig:
    #: where alerts go; ``callback`` / ``webhook`` are added when those keys are set, and
    #: ``wandb`` is skipped while no W&B run is active in the process
    sinks: list = field(default_factory=lambda: ["console", "file", "wandb"])
    callbacks: list = field(default_factory=list)
    webhooks: list = field(default_factory=list)
    user_rules: list = field(default_factory=list)
    #: rules not run; by default ``slowdown`` (a rank against its own history: live, load from other
    #: processes moves it too often; the doctor reports it). ``"disable": []`` runs every rule
    disable: tuple = ("slowdown",)
    #: the loop is stalled when no step reached the logger for ``stall_s`` seconds (default:
    #: max(``stall_floor_s``, ``stall_factor`` x the median time between steps))
    stall_s: float | None = None
    stall_factor: float = 10.0
    stall_floor_s: float = 5.0
    #: alerts waiting for the webhook / callback / W&B thread; beyond, they are dropped and counted
    queue_size: int = 1000
    webhook_timeout_s: float = 5.0
    #: the file sink's file, a relative path inside the run directory
    file_name: str = "alerts.jsonl"
    #: at shutdown, run ``forge-obs doctor`` on the run and hand its findings to W&B (a table in
    #: the run's summary) and TensorBoard (text)
    final_doctor: bool = True
    doctor: DoctorConfig = field(default_factory=DoctorConfig)

    OWN_KEYS = ("sinks", "callback", "webhook", "rules", "disable", "stall_s", "stall_factor", "stall_floor_s",
                "queue_size", "webhook_timeout_s", "file_name", "final_doctor")

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [*cls.OWN_KEYS, *DoctorConfig.names()]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any] | None) -> "AlertsConfig":
        cfg = dict(cfg or {})
        check_keys("alerts", cfg, cls.valid_keys())
        out = cls()
        out._parse_sinks(cfg)
        rules = cfg.get("rules") or []
        if not isinstance(rules, (list, tuple)):
            raise ValueError(f'alerts: rules must be a list of rules, e.g. ["trainer/loss > 10"], got '
                             f"{type(rules).__name__} {redacted_repr(rules)}")
        with redacted_errors():  # the rule's own check quotes it
            out.user_rules = [UserRule.parse(r) for r in rules]
        dis = cfg.get("disable", out.disable) or ()
        dis = (dis,) if isinstance(dis, str) else tuple(dis)
        for d in dis:
            if d not in RULE_NAMES:
                raise ValueError(f"alerts: cannot disable unknown rule {redacted_repr(d)}; valid: {', '.join(RULE_NAMES)}")
        out.disable = dis
        out._parse_numbers(cfg)
        if cfg.get("file_name") is not None:
            out.file_name = check_run_path(cfg["file_name"], "alerts: file_name")
        if not isinstance(cfg.get("final_doctor", True), bool):
            raise ValueError(f"alerts: final_doctor must be true or false, got {redacted_repr(cfg['final_doctor'])}")
        out.final_doctor = cfg.get("final_doctor", True)
        with redacted_errors():  # the doctor's checks quote the value
            out.doctor = DoctorConfig.from_dict({k: v for k, v in cfg.items() if k in DoctorConfig.names()})
        return out

    def _parse_sinks(self, cfg: dict[str, Any]) -> None:
        """``sinks``, ``callback`` and ``webhook`` (a callback or webhook given adds its sink)."""
        if "sinks" in cfg:
            sinks = cfg["sinks"]
            sinks = [sinks] if isinstance(sinks, str) else list(sinks or [])
            for s in sinks:
                if s not in SINKS:
                    raise ValueError(f"alerts: unknown sink {redacted_repr(s)}; valid: {', '.join(SINKS)}")
            self.sinks = sinks
        cbs = cfg.get("callback")
        if cbs is not None:
            cbs = list(cbs) if isinstance(cbs, (list, tuple)) else [cbs]
            for cb in cbs:
                if not callable(cb):
                    raise ValueError(f"alerts: callback must be a callable taking the alert dict, got {redacted_repr(cb)}")
            self.callbacks = cbs
            if "callback" not in self.sinks:
                self.sinks.append("callback")
        hooks = cfg.get("webhook")
        if hooks is not None:
            hooks = [hooks] if isinstance(hooks, str) else list(hooks)
            for h in hooks:
                u = urlparse(str(h))
                if u.scheme not in ("http", "https") or not u.netloc:
                    raise ValueError(f"alerts: webhook must be an http(s) URL such as http://127.0.0.1:9000/hook, got {redacted_repr(h)}")
            self.webhooks = [str(h) for h in hooks]
            if "webhook" not in self.sinks:
                self.sinks.append("webhook")
        if "callback" in self.sinks and not self.callbacks:
            raise ValueError("alerts: sink 'callback' needs 'callback': a callable taking the alert dict")
        if "webhook" in self.sinks and not self.webhooks:
            raise ValueError("alerts: sink 'webhook' needs 'webhook': an http(s) URL")

    def _parse_numbers(self, cfg: dict[str, Any]) -> None:
        """The positive numbers: the stall watchdog's, the sink queue's size, the webhook timeout."""
        for k, conv in (("stall_s", float), ("stall_factor", float), ("stall_floor_s", float), ("queue_size", int),
                        ("webhook_timeout_s", float)):
            if cfg.get(k) is not None:
                try:
                    v = conv(cfg[k])
                except (TypeError, ValueError):
                    raise ValueError(f"alerts: {k} must be a number, got {redacted_repr(cfg[k])}") from None
                if v <= 0:
                    raise ValueError(f"alerts: {k} must be > 0, got {redacted_repr(cfg[k])}")
                setattr(self, k, v)
