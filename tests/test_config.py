"""Gateway config: validation with field paths, env overrides, profiles, the shipped default."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvindex.keys import Namespace
from router.config import ConfigError, apply_env_overrides, build_config, load_config

ROOT = Path(__file__).resolve().parent.parent
TOK = "configs/assets/tiny-tokenizer"


def _base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"models": [{"id": "m", "tokenizer": TOK}]}
    d.update(over)
    return d


def test_default_config_loads_and_matches_the_sim_profile() -> None:
    cfg = load_config(ROOT / "configs/default.yaml", environ={})
    m = cfg.models[0]
    prof = yaml.safe_load((ROOT / "configs/profiles/h200-llama3.1-8b.yaml").read_text())
    assert m.id == prof["model"]
    ns = Namespace(m.id, m.namespace.revision, m.namespace.tokenizer_revision, m.namespace.kv_dtype,
                   m.namespace.parallel, m.namespace.block_size)
    ref = Namespace(prof["model"], prof.get("revision", ""), prof.get("tokenizer_revision", ""), prof["kv_dtype"],
                    prof["parallel"], prof["block_size"])
    assert ns.digest == ref.digest  # the digest the simulated workers report in /info
    assert m.cost.block_bytes == 2 * 32 * 8 * 128 * 2 * 16
    assert m.cost.prefill_tokens_per_s == prof["compute"]["prefill_tokens_per_s"]
    assert set(m.cost.links) == {"CPU", "DISK", "REMOTE", "PEER"}
    assert m.max_context_tokens == prof["max_context_tokens"]
    assert m.tokenizer.is_dir()
    assert cfg.routing.policy == "kv_cost"


@pytest.mark.parametrize(
    "data, where",
    [
        (_base(workers=[{"id": "w0", "url": "localhost:9000"}]), "workers.0.url"),
        (_base(workers=[{"id": "w0", "url": "http://x:1", "kind": "sglang"}]), "workers.0.kind"),
        (_base(workers=[{"id": "w0", "url": "http://x:1"}, {"id": "w0", "url": "http://x:2"}]), "duplicate worker id"),
        (_base(workers=[{"id": "w0", "url": "http://x:1", "model": "other"}]), "unknown model"),
        (_base(workers=[{"id": "w0", "url": "http://x:1", "events": {"endpoint": "localhost:5"}}]),
         "workers.0.events.endpoint"),
        (_base(routing={"retries": 9}), "routing.retries"),
        (_base(limits={"max_body_bytes": -1}), "limits.max_body_bytes"),
        (_base(tenants=[{"id": "a", "api_keys": ["short"]}]), "tenants.0.api_keys"),
        (_base(tenants=[{"id": "a", "api_keys": ["k" * 10]}, {"id": "b", "api_keys": ["k" * 10]}]), "also given"),
        (_base(surprise=1), "surprise"),
        ({"models": []}, "models"),
        ({"models": [{"id": "m", "tokenizer": "nowhere"}]}, "models[0].tokenizer"),
        (_base(models=[{"id": "m", "tokenizer": TOK, "cost": {"links": {"TAPE": {"read_Bps": 1}}}}]), "unknown tier"),
        (_base(shared_prefixes=[{"name": "s", "text": "a", "token_ids": [1]}]), "exactly one"),
    ],
)
def test_bad_config_names_the_field(data: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as ei:
        build_config(data, ROOT, environ={})
    msg = str(ei.value).replace("[", ".").replace("]", "")
    assert where.replace("[", ".").replace("]", "") in msg, msg


def test_env_overrides_nested_and_lists() -> None:
    env = {
        "KVROUTE_LISTEN__PORT": "9123",
        "KVROUTE_ROUTING__POLICY": "round_robin",
        "KVROUTE_ROUTING__PREFETCH__ENABLED": "false",
        "KVROUTE_WORKERS__0__URL": "http://127.0.0.1:7000",
        "KVROUTE_ADMIN_TOKEN": "secret-admin",
        "KVROUTE_PEER_TOKEN": "a worker's, not the gateway's",
        "OTHER": "ignored",
    }
    cfg = build_config(_base(workers=[{"id": "w0", "url": "http://127.0.0.1:1"}]), ROOT, environ=env)
    assert cfg.listen.port == 9123 and cfg.routing.policy == "round_robin"
    assert cfg.routing.prefetch.enabled is False
    assert cfg.workers[0].url == "http://127.0.0.1:7000" and cfg.workers[0].model == "m"
    assert cfg.admin_token == "secret-admin"
    with pytest.raises(ConfigError, match="KVROUTE_WORKERS__3__URL"):
        build_config(_base(workers=[]), ROOT, environ={"KVROUTE_WORKERS__3__URL": "http://x:1"})
    with pytest.raises(ConfigError, match="listen.port"):
        build_config(_base(), ROOT, environ={"KVROUTE_LISTEN__PORT": "not-a-port"})
    assert apply_env_overrides({}, {"KVROUTE_A__B": "[1, 2]"}) == {"a": {"b": [1, 2]}}


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p, environ={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.symlink_to(ROOT / TOK)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"models": [{"id": "m", "tokenizer": "tok", "profile": "tiny-cpu"}],
                                 "observability": {"trace": {"enabled": True, "path": "t.jsonl"}}}))
    cfg = load_config(p, environ={})
    assert cfg.models[0].tokenizer == tmp_path / "tok"
    assert cfg.observability.trace.path == tmp_path / "t.jsonl"
    assert cfg.models[0].namespace.kv_dtype == "float32"  # from the tiny-cpu profile
    explicit = build_config({"models": [{"id": "m", "tokenizer": TOK, "profile": "tiny-cpu",
                                         "namespace": {"kv_dtype": "fp8"}, "cost": {"prefill_tokens_per_s": 5.0}}]},
                            ROOT, environ={})
    assert explicit.models[0].namespace.kv_dtype == "fp8" and explicit.models[0].namespace.block_size == 16
    assert explicit.models[0].cost.prefill_tokens_per_s == 5.0 and explicit.models[0].cost.block_bytes == 65536


def test_unknown_profile_and_policy_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="profile"):
        build_config({"models": [{"id": "m", "tokenizer": TOK, "profile": "no-such-profile"}]}, ROOT, environ={})
    with pytest.raises(ConfigError, match=r"routing: .*unknown routing policy 'fastest'; choose one of: round_robin"):
        build_config(_base(routing={"policy": "fastest"}), ROOT, environ={})
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) 'tie_margn' for policy 'kv_cost'"):
        build_config(_base(routing={"params": {"tie_margn": 0.1}}), ROOT, environ={})
    with pytest.raises(ConfigError, match=r"'tie_margin' must be <= 1.0"):
        build_config(_base(routing={"params": {"tie_margin": 5}}), ROOT, environ={})


def test_env_overrides_add_workers_to_an_empty_list() -> None:
    """The README's example works on the shipped default (which lists no workers)."""
    env = {"KVROUTE_WORKERS__0__ID": "w0", "KVROUTE_WORKERS__0__URL": "http://127.0.0.1:9000",
           "KVROUTE_WORKERS__1__ID": "w1", "KVROUTE_WORKERS__1__URL": "http://127.0.0.1:9001"}
    cfg = load_config(ROOT / "configs/default.yaml", environ=env)
    assert [(w.id, w.url) for w in cfg.workers] == [("w0", "http://127.0.0.1:9000"), ("w1", "http://127.0.0.1:9001")]
    with pytest.raises(ConfigError, match="KVROUTE_WORKERS__2__URL: no list element '2'"):
        load_config(ROOT / "configs/default.yaml", environ={"KVROUTE_WORKERS__2__URL": "http://127.0.0.1:9"})


def test_a_policy_typo_is_one_line_from_the_cli(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"models": [{"id": "m", "tokenizer": str(ROOT / TOK)}],
                                 "routing": {"policy": "kv_cots"}}))
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(p)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown routing policy 'kv_cots'" in r.stderr, r.stderr
