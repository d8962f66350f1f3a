"""Gateway config: validation with field paths, env overrides, profiles, the shipped default."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvindex.keys import Namespace
from loadtest.ports import free_port
from router.config import ConfigError, apply_env_overrides, build_config, load_config

ROOT = Path(__file__).resolve().parents[2]
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
        (_base(workers=[{"id": "w0", "url": "http://x:1", "kind": "tgi"}]), "workers.0.kind"),
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
    assert apply_env_overrides({}, {"KVROUTE_LIMITS__B": "[1, 2]"}) == {"limits": {"b": [1, 2]}}


# What Kubernetes injects into every pod for the Services `kvroute-gateway` and `kvroute-valkey`.
SERVICE_LINKS = {
    "KVROUTE_GATEWAY_SERVICE_HOST": "10.0.0.1",
    "KVROUTE_GATEWAY_SERVICE_PORT": "8000",
    "KVROUTE_GATEWAY_SERVICE_PORT_HTTP": "8000",
    "KVROUTE_GATEWAY_PORT": "tcp://10.0.0.1:8000",
    "KVROUTE_GATEWAY_PORT_8000_TCP": "tcp://10.0.0.1:8000",
    "KVROUTE_GATEWAY_PORT_8000_TCP_PROTO": "tcp",
    "KVROUTE_GATEWAY_PORT_8000_TCP_PORT": "8000",
    "KVROUTE_GATEWAY_PORT_8000_TCP_ADDR": "10.0.0.1",
    "KVROUTE_VALKEY_SERVICE_HOST": "10.0.0.2",
    "KVROUTE_VALKEY_SERVICE_PORT": "6379",
    "KVROUTE_VALKEY_PORT": "tcp://10.0.0.2:6379",
    "KVROUTE_WORKERS_SERVICE_HOST": "10.0.0.3",
    "KVROUTE_SOMETHING_ELSE": "whatever",
}


def test_service_links_and_unknown_variables_are_warned_about_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    env = {**SERVICE_LINKS, "KVROUTE_LISTEN__PORT": "9124", "KVROUTE_ADMIN_TOKEN": "t"}
    with caplog.at_level("WARNING", logger="kvroute.config"):
        cfg = build_config(_base(), ROOT, environ=env)
    assert cfg.listen.port == 9124 and cfg.admin_token == "t"  # real overrides still apply
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "KVROUTE_GATEWAY_PORT" in warned and "KVROUTE_SOMETHING_ELSE" in warned
    assert "tcp://10.0.0.1" not in warned  # names only: a value may be a secret
    # a variable that does name a section is still checked: a typo there is a config error
    with pytest.raises(ConfigError, match="listen"):
        build_config(_base(), ROOT, environ={"KVROUTE_LISTEN__PROT": "1"})


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
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) 'balance_esp' for policy 'kv_cost'"):
        build_config(_base(routing={"params": {"balance_esp": 0.1}}), ROOT, environ={})
    with pytest.raises(ConfigError, match=r"'balance_eps' must be >= 0.0"):
        build_config(_base(routing={"params": {"balance_eps": -5}}), ROOT, environ={})


def test_a_former_policy_setting_fails_at_start_naming_its_constant(tmp_path: Path) -> None:
    """`routing.params` naming a kv_cost setting that became a constant (docs/planner.md,
    "Settings") is refused by the YAML loader with what became of it."""
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_base(routing={"params": {"tie_margin": 0.1}})))
    with pytest.raises(ConfigError, match=r"'tie_margin' is no longer a setting: it is the fixed constant "
                                          r"TIE_MARGIN = 0\.03 \(docs/planner\.md, \"Settings\"\)"):
        load_config(p, environ={})
    with pytest.raises(ConfigError, match=r"'memory_weight' is no longer a setting.*`saturation: false`"):
        build_config(_base(routing={"params": {"memory_weight": 0}}), ROOT, environ={})
    cfg = build_config(_base(routing={"params": {"saturation": False}, "max_ttft_s": 2.0}), ROOT, environ={})
    assert cfg.routing.policy_kwargs() == {"saturation": False, "max_ttft_s": 2.0}


def test_env_overrides_add_workers_to_an_empty_list() -> None:
    """docs/config.md's example works on the shipped default (which lists no workers)."""
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


def test_gateway_process_starts_with_kubernetes_service_links(tmp_path: Path) -> None:
    """The gateway as a pod runs it: `kvroute serve` with the service links in its environment."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update(SERVICE_LINKS)
    env["PYTHONPATH"] = str(ROOT)
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config",
                                 str(ROOT / "configs/default.yaml"), "--port", str(port)],
                                cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        status = _wait_health(f"http://127.0.0.1:{port}/health", proc)
        assert status == 200, log.read_text()[-3000:]
        assert "KVROUTE_GATEWAY_SERVICE_HOST" in log.read_text()  # warned about
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_health(url: str, proc: subprocess.Popen[bytes]) -> int | None:
    """/health's status once the process answers; None when it exited first. The bound is
    only against a hang (start-up takes seconds, far longer on a loaded machine)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return int(r.status)
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return None
