"""One redaction function for every place config is written: meta.json, the W&B config (read
back from the offline ``.wandb`` file and W&B's own logs), our logs and the report."""

from __future__ import annotations

import json
import logging
import re

import pytest

from forge_obs.core.redact import MASK, is_secret_name, redact, redact_text
from forge_obs.core.run import write_meta

# every name of the issue, each with its own secret value so a leak names the culprit
SECRETS = {
    "aws_secret_access_key": "AWSSECRETVALUE0001",
    "private_key": "PRIVATEKEYVALUE0002",
    "openai_key": "OPENAIKEYVALUE0003",
    "key": "PLAINKEYVALUE0004",
    "wandb_key": "WANDBKEYVALUE0005",
    "passwd": "PASSWDVALUE0006",
    "auth": "AUTHVALUE0007",
    "credentials": "CREDENTIALSVALUE0008",
    "ssh_passphrase": "PASSPHRASEVALUE0009",
    "github_pat": "GITHUBPATVALUE0010",
    "hf_token": "HFTOKENVALUE0011",
    "apiKey": "CAMELCASEVALUE0012",
    "DB_PASSWORD": "UPPERVALUE0013",
    "session_cookie": "COOKIEVALUE0014",
    "client-secret": "DASHVALUE0015",
    "pwd": "PWDVALUE0016",
    "hf_tokens": "HFTOKENSVALUE0017",
    "refresh_tokens": "REFRESHTOKENSVALUE0018",
}
VALUE_SECRETS = {
    # secrets recognised by their value, whatever the name
    "headers": {"Authorization": "Bearer BEARERVALUE0101", "Accept": "json"},
    "header_line": "Authorization: Bearer BEARERVALUE0102",
    "bare_bearer": "Bearer BEARERVALUE0103",
    "db_url": "postgres://alice:URLPASSWORD0104@db.example.com:5432/rl",
    "webhook": "https://hooks.example.com/x?token=QUERYVALUE0105&channel=ops",
    "command": "python train.py --api-key CLIVALUE0106 --lr 3e-4",
    "env_line": "OPENAI_API_KEY=ENVVALUE0107",
    "argv": ["--password", "ARGVVALUE0108", "--epochs", "3"],
    "openai_format": "sk-proj-abcdefghijklmnop0109XYZ",
    "github_format": "ghp_abcdefghijklmnopqrstuv0110",
    "aws_id_format": "AKIAABCDEFGHIJKL0111",
    "hf_format": "hf_abcdefghijklmnopqrstuvwx0112",
    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIBOgPEMVALUE0113\n-----END RSA PRIVATE KEY-----",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0abc.SIGNATUREVALUE0114xyz",
    "json_string": '{"wandb": {"api_key": "JSONSTRINGVALUE0115"}}',
}
# harmless names an RL config contains: kept as they are
HARMLESS = {
    "max_tokens": 512, "max_new_tokens": 64, "num_tokens": 10, "max_num_batched_tokens": 8192,
    "tokenizer": "Qwen/Qwen3-1.7B", "tokenizer_path": "/models/tok", "pad_token_id": 0, "eos_token": "</s>",
    "stop_token_ids": [1, 2], "key_prefix": "trainer/", "sort_key": "step", "metric_keys": ["loss"],
    "path": "/data/x", "patience": 3, "pattern": "*.jsonl", "patch_size": 14, "spatial_merge": 2,
    "compat": True, "num_passes": 2, "pass_at_k": 8, "author": "alice", "keyword": "math",
    "kv_cache_dtype": "fp8", "passage_len": 128, "bypass_cache": False, "rng_key": 0,
}


def _config():
    return {"model": {"lr": 3e-4, **HARMLESS}, "section": dict(SECRETS), "nested": [dict(VALUE_SECRETS)],
            "objects": [{"token": "LISTTOKEN0201"}, ("tuple", {"secret": "TUPLESECRET0202"})]}


def _leaks(text: str) -> list[str]:
    values = [*SECRETS.values(), "LISTTOKEN0201", "TUPLESECRET0202"]
    values += [v for v in ("BEARERVALUE0101", "BEARERVALUE0102", "BEARERVALUE0103", "URLPASSWORD0104",
                           "QUERYVALUE0105", "CLIVALUE0106", "ENVVALUE0107", "ARGVVALUE0108", "0109XYZ",
                           "v0110", "JKL0111", "wx0112", "MIIBOgPEMVALUE0113", "SIGNATUREVALUE0114",
                           "JSONSTRINGVALUE0115")]
    return [v for v in values if v in text]


def test_every_name_and_value_of_the_issue_is_redacted():
    out = redact(_config())
    assert _leaks(json.dumps(out)) == []
    assert all(v == MASK for v in out["section"].values())
    assert out["model"] == {"lr": 3e-4, **{k: list(v) if isinstance(v, tuple) else v for k, v in HARMLESS.items()}}
    n = out["nested"][0]
    assert n["headers"] == {"Authorization": MASK, "Accept": "json"}
    assert n["db_url"] == f"postgres://alice:{MASK}@db.example.com:5432/rl"
    assert n["webhook"] == f"https://hooks.example.com/x?token={MASK}&channel=ops"
    assert n["command"] == f"python train.py --api-key {MASK} --lr 3e-4"
    assert n["argv"] == ["--password", MASK, "--epochs", "3"]
    assert n["bare_bearer"] == f"Bearer {MASK}"


@pytest.mark.parametrize("name", list(SECRETS) + ["api_key", "access_token", "auth_token", "secret", "pass",
                                                   "password", "credential", "privateKey", "cookie", "session_id",
                                                   "AWS_SECRET_ACCESS_KEY", "gh_pat", "x-api-key", "token", "keys"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", list(HARMLESS))
def test_harmless_names(name):
    assert not is_secret_name(name)


def test_bools_and_none_under_secret_names_are_kept_and_containers_are_masked_whole():
    cfg = {"use_password": True, "api_key": None, "private": True, "use_auth": False, "session_timeout_s": None,
           "credentials": {"user": "u", "pw": "PW"}, "num_tokens": [1], "token": 12345}
    assert redact(cfg) == {**cfg, "credentials": MASK, "token": MASK}


def test_redact_never_raises_and_copies():
    class Weird:
        def __str__(self):
            raise RuntimeError("no str")

    cyc: dict = {"a": 1}
    cyc["self"] = cyc
    cfg = {"w": Weird(), "cyc": cyc, 3: "x", ("t",): "y", "deep": [[[[{"password": "DEEP"}]]]]}
    out = redact(cfg)
    assert "DEEP" not in json.dumps(out, default=str) and out["cyc"]["a"] == 1
    assert cfg["deep"][0][0][0][0]["password"] == "DEEP"  # the input is not modified
    assert redact_text("nothing secret here: lr=0.1") == "nothing secret here: lr=0.1"


def test_meta_json_is_redacted(tmp_path):
    write_meta(tmp_path / "r", config=_config(), status="running")
    text = (tmp_path / "r" / "meta.json").read_text()
    assert _leaks(text) == [] and "max_new_tokens" in text and json.loads(text)["status"] == "running"


def test_wandb_config_debug_log_and_meta_json_hold_no_secret(tmp_path, monkeypatch, caplog):
    """Real W&B, offline: the .wandb file, W&B's debug logs and every other file of the run."""
    pytest.importorskip("wandb")
    from tests.support.wandb_reader import find_run_file, read_run

    from forge_obs.backends.wandb import WandbBackend
    from forge_obs.backends.record import RunContext, StepRecord

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    caplog.set_level(logging.DEBUG)
    backends = {"wandb": {"mode": "offline", "config": _config()}}
    be = WandbBackend(backends["wandb"])
    run = RunContext(run_id="exp1", run_dir=tmp_path / "exp1", config=redact(backends))
    be.init(run=run)
    be.log_step(StepRecord(step=0, run_id="exp1", wall_time=1.0, global_metrics=[]))
    be.finish()
    write_meta(run.run_dir, config=backends)
    wb = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1"))
    assert wb.config["model"]["max_tokens"] == 512 and wb.config["section"]["openai_key"] == MASK
    assert wb.config["forge_obs"]["backends"]["wandb"]["config"]["section"]["key"] == MASK
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "debug.log" for p in files) and any(p.suffix == ".wandb" for p in files)
    for p in files:
        assert _leaks(p.read_bytes().decode("utf-8", "replace")) == [], p
    assert _leaks(caplog.text) == []


def test_wandb_uses_the_one_redaction_function():
    import inspect

    import forge_obs.backends.wandb as wandb_backend

    src = inspect.getsource(wandb_backend)
    assert "_SECRET_KEY" not in src and "def redact_secrets" not in src
    assert re.search(r"from forge_obs\.core\.redact import [\w, ]*\bredact\b", src)


# ------------------------------------------------------------------ a `tokens` suffix, JSON in strings
#: names ending in token/tokens that hold credentials: no allow-listed word makes them harmless
TOKEN_SECRETS = {"tokens": "E1", "hf_tokens": "E2", "access_tokens": "E3", "refresh_tokens": "E4",
                 "api_tokens": "E6", "id_token": "E7", "tokenizer_hf_token": "E8", "authTokens": "E9",
                 "keyword_api_key": "E10"}
#: count, kind and property words make them metric-ish names, kept
TOKEN_HARMLESS = {"max_tokens": 512, "num_tokens": 3, "n_tokens": 4, "total_tokens": 5, "min_tokens": 1,
                  "max_new_tokens": 64, "max_num_batched_tokens": 8192, "tokens_per_s": 2750.0,
                  "prompt_tokens": 10, "completion_tokens": 20, "special_tokens": ["<s>"], "stop_tokens": ["</s>"],
                  "pad_token": "<pad>", "token_ids": [1, 2], "tokens_budget": 9, "nTokens": 7}


@pytest.mark.parametrize("name", list(TOKEN_SECRETS))
def test_a_token_suffix_is_a_secret_whatever_the_allow_list(name):
    assert is_secret_name(name)
    assert redact({name: TOKEN_SECRETS[name]}) == {name: MASK}


@pytest.mark.parametrize("name", list(TOKEN_HARMLESS))
def test_count_kind_and_property_words_keep_token_names_visible(name):
    assert not is_secret_name(name)
    assert redact({name: TOKEN_HARMLESS[name]}) == {name: TOKEN_HARMLESS[name]}


@pytest.mark.parametrize("text, expected", [
    ('{"api_key": "E5"}', '{"api_key": "***"}'),
    ('{"wandb": {"hf_tokens": ["E11", "E12"], "project": "p"}}',
     '{"wandb": {"hf_tokens": "***", "project": "p"}}'),
    ('[{"password": 13}, "free text"]', '[{"password": "***"}, "free text"]'),
    ("{'api_key': 'E14', 'lr': 0.1}", "{'api_key': '***', 'lr': 0.1}"),  # a Python repr: not JSON
    ('prefix {"api_key": "E15"} suffix', 'prefix {"api_key": "***"} suffix'),  # JSON inside text
    ('{"max_tokens": 512}', '{"max_tokens": 512}'),  # harmless JSON is left as it was
    ('{"broken": "E16", "token": "E17"', '{"broken": "E16", "token": "***"'),  # not JSON: text rules
    ('cfg: {"a": 1} and --token E18', 'cfg: {"a": 1} and --token ***'),  # a flag after a word
])
def test_secret_names_inside_json_strings_are_redacted(text, expected):
    assert redact({"extra": text}) == {"extra": expected}
    assert redact([text]) == [expected]


def test_meta_json_has_no_token_suffix_or_json_string_secret(tmp_path):
    write_meta(tmp_path / "r", config={"app": {**TOKEN_SECRETS, **TOKEN_HARMLESS, "extra": '{"api_key": "E5"}'}})
    text = (tmp_path / "r" / "meta.json").read_text()
    app = json.loads(text)["config"]["app"]
    assert [v for v in (*TOKEN_SECRETS.values(), "E5") if re.search(rf"\b{v}\b", text)] == []
    assert {k: app[k] for k in TOKEN_HARMLESS} == TOKEN_HARMLESS


def test_the_report_redacts_a_meta_json_written_in_clear(tmp_path):
    """A meta.json written by something else (an older forge_obs, a script) is redacted again
    when the report shows it."""
    from forge_obs.analysis.report.html import render_report

    run = tmp_path / "r"
    run.mkdir()
    settings = {**TOKEN_SECRETS, **TOKEN_HARMLESS, "extra": '{"api_key": "E5"}'}
    (run / "meta.json").write_text(json.dumps({"status": "finished", "app_settings": settings,
                                               "config": {"mine": settings}}))
    (run / "metrics.jsonl").write_text('{"step": 0, "mode": "global_reduce", "metrics": {"loss": 1.0}}\n')
    page = render_report(run)
    assert [v for v in (*TOKEN_SECRETS.values(), "E5") if re.search(rf"\b{v}\b", page)] == []
    assert "max_new_tokens" in page and "tokens_per_s" in page


# ------------------------------------------------------------------ dict keys, SAMPLE rows, error messages
KEY_SECRET = "ghp_abcdefghijklmnopqrstuv0301"
ROW_SECRET = "sk-proj-abcdefghijklmnop0302XYZ"


def test_a_secret_used_as_a_dict_key_is_redacted_and_its_siblings_kept(tmp_path):
    """A token as a key (a per-user map): the key is masked wherever the config is written; two
    masked keys stay two entries; the values under them and the harmless keys are kept."""
    cfg = {"app": {"users": {KEY_SECRET: 3, "ghp_zyxwvutsrqponmlkjihgf0303": 4, "alice": 5}, "lr": 0.1}}
    out = redact(cfg)
    users = out["app"]["users"]
    assert KEY_SECRET not in json.dumps(out) and "0303" not in json.dumps(out)
    assert sorted(users.values()) == [3, 4, 5] and users["alice"] == 5 and out["app"]["lr"] == 0.1
    assert sorted(k for k in users if k != "alice") == [MASK, f"{MASK} (2)"]
    write_meta(tmp_path / "r", config=cfg)
    assert KEY_SECRET not in (tmp_path / "r" / "meta.json").read_text()


def test_the_report_shows_no_secret_dict_key(tmp_path):
    from forge_obs.analysis.report.html import render_report

    run = tmp_path / "r"
    write_meta(run, config={"app": {KEY_SECRET: 1, "lr": 0.1}}, status="finished")
    (run / "metrics.jsonl").write_text('{"step": 0, "mode": "global_reduce", "metrics": {"loss": 1.0}}\n')
    page = render_report(run)
    assert KEY_SECRET not in page and "lr" in page


def test_sample_rows_are_redacted_by_plain_with_the_one_rule():
    """What every backend receives of a SAMPLE row (:func:`forge_obs.core.plain.plain`): the
    value of a secret-looking field, a JSON string holding one, a key format in free text, a
    secret dict key and a secret flag's argument are masked; every other field is kept as it was."""
    from forge_obs.core.plain import plain

    row = {"prompt": "What is 1+1?", "api_key": ROW_SECRET, "reward": 1.0, "n": 3, "ok": True,
           "meta": json.dumps({"wandb": {"token": "E0304"}, "lr": 0.1}),
           "completion": f"use {ROW_SECRET} to call the API", "by_user": {KEY_SECRET: 2},
           "argv": ["--password", "E0305", "--epochs", "3"], "pair": ("a", "Bearer E0306X")}
    out = plain(row)
    text = json.dumps(out)
    assert [s for s in (ROW_SECRET, KEY_SECRET, "E0304", "E0305", "E0306X") if s in text] == []
    assert {k: out[k] for k in ("prompt", "reward", "n", "ok")} == {"prompt": "What is 1+1?", "reward": 1.0, "n": 3,
                                                                     "ok": True}
    assert out["api_key"] == MASK and out["completion"] == f"use {MASK} to call the API"
    assert json.loads(out["meta"]) == {"wandb": {"token": MASK}, "lr": 0.1}
    assert out["by_user"] == {MASK: 2} and out["argv"] == ["--password", MASK, "--epochs", "3"]
    assert out["pair"] == ("a", f"Bearer {MASK}")
    assert row["api_key"] == ROW_SECRET  # the user's row is not modified
    import numpy as np

    assert plain({"text": np.str_(f"key {ROW_SECRET}")}) == {"text": f"key {MASK}"}  # a str subclass too


def test_a_row_without_secrets_is_passed_on_as_it_is():
    from forge_obs.core.plain import plain

    row = {"prompt": "the answer is 2", "reward": 1.0, "tokens_per_s": 3.5, "response_tokens": [1, 2]}
    assert plain(row) is row



#: a word of every pattern's pre-check, none of them a credential and none able to join the text
#: after it: text after these lines is scanned by every pattern
_EVERY_PATTERN = "(key, bearer, authorization, ://, sk-, PRIVATE KEY-----)\n"
_FRAGMENTS = ["sk-proj-abcdefghijklmnopq", "ghp_abcdefghijklmnopqrstuv", "github_pat_abcdefghijklmnopqrstuv",
              "AKIAABCDEFGHIJKLMNOP", "ASIAABCDEFGHIJKLMNOP", "hf_abcdefghijklmnopqrstuv", "xoxb-1234567890ab",
              "AIza" + "a" * 35, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0abc.SIGNATURExyz", "sk_live_abcdefghijklmnop",
              "Bearer abc.def", "Authorization: Basic xyz", "PROXY-AUTHORIZATION=x", "password=hunter2",
              "--token x", "-pw y", "?token=y&a=b", "postgres://u:p@h/db", '"api_key": "v"', "apiKey: v",
              "-----BEGIN RSA PRIVATE KEY-----\nabc\n-----END RSA PRIVATE KEY-----", "İ", "ı", "\u212a", "ſ",
              "AUTHORİZATİON: z", "authorızation: z", "toſken=q", " ", "\n", "=", ":", "-", "key", "pin", "sig"]


def test_the_pre_checks_never_change_what_is_masked():
    """Whatever the text, redact_text masks exactly what the full scan of every pattern masks:
    the substring pre-checks only skip patterns that cannot match."""
    from hypothesis import given, settings, strategies as st

    text = st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=8), max_size=12).map("".join)

    @settings(max_examples=400, deadline=None)
    @given(text)
    def check(s):
        assert redact_text(_EVERY_PATTERN + s) == _EVERY_PATTERN + redact_text(s)

    check()
