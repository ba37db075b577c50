"""GatewayConfig: sources, precedence, validation messages that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.config import DEFAULT_SESSION_HEADERS, GatewayConfig, load_config, replica_id_from_url
from router.errors import ConfigError


def test_defaults() -> None:
    c = load_config([], {})
    assert c.host == "127.0.0.1"
    assert c.policy == "kv_aware"
    assert c.session_headers == DEFAULT_SESSION_HEADERS
    assert c.routing_key_header == "x-smg-routing-key"
    assert c.decision_headers is True
    assert c.limits.max_body_bytes == 16 * 1024 * 1024
    assert c.limits.max_session_id_len == 256
    assert c.max_retries == 2
    assert c.health.scrape_interval_s == 1.0
    assert c.redis_url is None and c.admin_token is None
    assert c.store.to_store_config().session_ttl_s == 3600.0


def test_frozen() -> None:
    c = load_config([], {})
    with pytest.raises(ValidationError):
        c.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        c.limits.max_body_bytes = 1  # type: ignore[misc]


def test_constructing_never_reads_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_PORT", "1234")
    assert GatewayConfig().port == 8000
    assert load_config([], {}).port == 8000


def test_serve_flags() -> None:
    c = load_config(
        [
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--replica",
            "http://10.0.0.5:30000/",
            "--replica",
            "http://10.0.0.6:30000",
            "--policy",
            "hash",
            "--no-decision-headers",
            "--policy-param",
            "thicc_threshold=4",
            "--set",
            "limits.max_body_bytes=2048",
            "--redis",
            "redis://127.0.0.1:6390/0",
            "--session-header",
            "X-Conv",
        ],
        {},
    )
    assert (c.host, c.port, c.policy, c.decision_headers) == ("0.0.0.0", 9000, "hash", False)
    assert c.replicas == ("http://10.0.0.5:30000", "http://10.0.0.6:30000")
    assert [s.id for s in c.replica_specs()] == ["10.0.0.5:30000", "10.0.0.6:30000"]
    assert all(s.dp_rank is None for s in c.replica_specs())
    assert c.policy_params == {"thicc_threshold": 4}
    assert c.policy_params_obj().thicc_threshold == 4
    assert c.limits.max_body_bytes == 2048
    assert c.redis_url == "redis://127.0.0.1:6390/0"
    assert c.session_headers == ("X-Conv",)


def test_env_nested_and_lists() -> None:
    env = {
        "KVROUTE_PORT": "9100",
        "KVROUTE_REPLICAS": "http://a:1,http://b:2",
        "KVROUTE_LIMITS__MAX_SESSION_ID_LEN": "64",
        "KVROUTE_TIMEOUTS__CONNECT_S": "0.5",
        "KVROUTE_SESSION_HEADERS": '["X-A", "X-B"]',
        "KVROUTE_POLICY_PARAMS": '{"max_overflow": 1}',
        "KVROUTE_ADMIN_TOKEN": "s3cret",
        "OTHER_VAR": "ignored",
    }
    c = load_config([], env)
    assert c.port == 9100
    assert c.replicas == ("http://a:1", "http://b:2")
    assert c.limits.max_session_id_len == 64
    assert c.timeouts.connect_s == 0.5
    assert c.session_headers == ("X-A", "X-B")
    assert c.policy_params == {"max_overflow": 1}
    assert c.admin_token is not None and c.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(c)


def test_precedence_cli_env_yaml_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "port: 7000\nhost: 0.0.0.0\nmax_retries: 1\nlimits:\n  max_body_bytes: 100\n  max_session_id_len: 32\n"
        "policy_params:\n  thicc_threshold: 5\n  max_overflow: 1\n"
    )
    env = {"KVROUTE_PORT": "7100", "KVROUTE_LIMITS__MAX_BODY_BYTES": "200", "KVROUTE_MAX_RETRIES": "3"}
    c = load_config(["--config", str(cfg), "--port", "7200", "--policy-param", "max_overflow=2"], env)
    assert c.port == 7200  # CLI beats env and YAML
    assert c.max_retries == 3  # env beats YAML
    assert c.limits.max_body_bytes == 200  # env beats YAML, key by key inside a section
    assert c.limits.max_session_id_len == 32  # YAML beats defaults
    assert c.host == "0.0.0.0"
    assert c.policy_params == {"thicc_threshold": 5, "max_overflow": 2}
    # KVROUTE_CONFIG names the file too
    assert load_config([], {"KVROUTE_CONFIG": str(cfg)}).port == 7000


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (
            [],
            {"KVROUTE_LIMITS__MAX_BODY_BYTES": "-1"},
            ["limits.max_body_bytes", "KVROUTE_LIMITS__MAX_BODY_BYTES"],
        ),
        ([], {"KVROUTE_PORT": "http"}, ["port", "KVROUTE_PORT"]),
        (["--port", "70000"], {}, ["port"]),
        (["--replica", "ftp://x:1"], {}, ["replicas", "ftp://x:1"]),
        (["--replica", "http://a:1", "--replica", "http://a:1/"], {}, ["replicas", "duplicate"]),
        (["--policy-param", "thicc_threshold=0"], {}, ["policy_params.thicc_threshold"]),
        (["--policy-param", "no_such_knob=1"], {}, ["policy_params.no_such_knob"]),
        (["--set", "timeouts.connect_s=abc"], {}, ["timeouts.connect_s"]),
        (["--set", "limits.session_id_pattern=(["], {}, ["limits.session_id_pattern"]),
        (["--set", "nope=1"], {}, ["nope"]),
        (["--session-header", "bad header"], {}, ["session_headers"]),
        (["--redis", "http://x"], {}, ["redis_url"]),
        (["--log-level", "loud"], {}, ["log_level"]),
        ([], {"KVROUTE_PROT": "1"}, ["KVROUTE_PROT", "did you mean 'port'"]),
        ([], {"KVROUTE_LOG_LEVLE": "1"}, ["KVROUTE_LOG_LEVLE", "log_level"]),
        ([], {"KVROUTE_LIMITS__NOPE": "1"}, ["KVROUTE_LIMITS__NOPE", "limits.nope"]),
    ],
)
def test_errors_name_the_key(argv: list[str], env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, env)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6390/0",
        "redis://:pw@10.0.0.5/3",
        "rediss://user:pw@redis.example:6380/1",
        "redis://127.0.0.1:7000/0?cluster=1",
        "rediss://h:6380?cluster=true&ssl_cert_reqs=none",
        "unix:///run/redis/redis.sock",
        "unix:///run/redis/redis.sock?db=2",
    ],
)
def test_redis_urls_the_store_takes_are_accepted(url: str) -> None:
    assert load_config(["--redis", url], {}).redis_url == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://:pw@127.0.0.1:99999/x", "bad port"),
        ("redis://:pw@127.0.0.1:0/0", "bad port"),
        ("redis://:pw@127.0.0.1:6379/x", "database must be a number"),
        ("redis://127.0.0.1:6379/x", "database must be a number"),
        ("redis://:pw@/0", "no host"),
        ("unix://", "socket's path"),
    ],
)
def test_redis_url_mistakes_are_named_without_the_password(url: str, problem: str) -> None:
    """The sidecar's check (router.store.url.check_redis_url): what redis-py would refuse later with a
    traceback, or silently read as db 0, is refused at start-up."""
    for argv, env in ((["--redis", url], {}), ([], {"KVROUTE_REDIS_URL": url})):
        with pytest.raises(ConfigError) as info:
            load_config(argv, env)
        msg = str(info.value)
        assert "redis_url" in msg and problem in msg and "pw" not in msg, msg


def test_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(["--config", str(bad)], {})
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(["--config", str(lst)], {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(tmp_path / "missing.yaml")], {})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("limits:\n  max_bodybytes: 1\n")
    with pytest.raises(ConfigError, match=r"limits\.max_bodybytes"):
        load_config(["--config", str(unknown)], {})


@pytest.mark.parametrize(
    ("url", "rid"),
    [
        ("http://127.0.0.1:31001", "127.0.0.1:31001"),
        ("http://host", "host:80"),
        ("https://h", "h:443"),
        ("http://[::1]:5", "[::1]:5"),
    ],
)
def test_replica_ids(url: str, rid: str) -> None:
    assert replica_id_from_url(url) == rid


def test_other_tools_variables_are_ignored() -> None:
    env = {
        "KVROUTE_SIDECAR_REDIS_URL": "redis://x",
        "KVROUTE_MODEL_PATH": "/m",
        "KVROUTE_VENV": "/v",
        "KVROUTE_SGLANG_PYTHON": "/p",
        "KVROUTE_CHROMIUM": "/c",
        "KVROUTE_PORT": "9200",
    }
    assert load_config([], env).port == 9200


def test_warm_handoff_flag_and_env() -> None:
    assert load_config([], {}).warm_handoff is False
    assert load_config(["--warm-handoff"], {}).warm_handoff is True
    assert load_config([], {"KVROUTE_WARM_HANDOFF": "true"}).warm_handoff is True


def test_store_replica_refresh_is_optional_and_validated() -> None:
    assert load_config([], {}).store.replica_refresh_s is None  # the Redis store then reads its env/default
    c = load_config([], {"KVROUTE_STORE__REPLICA_REFRESH_S": "0"})
    assert c.store.replica_refresh_s == 0.0
    assert "replica_refresh_s" not in c.store.to_store_config().__slots__
    with pytest.raises(ConfigError, match="replica_refresh_s"):
        load_config([], {"KVROUTE_STORE__REPLICA_REFRESH_S": "-1"})


def test_kv_events_off_reads_as_off_though_yaml_says_false(tmp_path: Path) -> None:
    """A bare ``off`` is YAML's false: in a file, in ``--set`` and in the environment it still means off."""
    cfg_file = tmp_path / "kvroute.yaml"
    cfg_file.write_text("kv_events:\n  mode: off\n")
    assert load_config(["--config", str(cfg_file)], {}).kv_events.mode == "off"
    assert load_config(["--set", "kv_events.mode=off"], {}).kv_events.mode == "off"
    assert load_config([], {"KVROUTE_KV_EVENTS__MODE": "off"}).kv_events.mode == "off"
    with pytest.raises(ConfigError, match="kv_events.mode"):
        load_config(["--set", "kv_events.mode=true"], {})


def test_replica_dp_ranks_makes_each_rank_of_each_engine_a_replica() -> None:
    c = load_config(["--replica", "http://10.0.0.5:30000", "--replica", "http://10.0.0.6:30000", "--replica-dp-ranks", "2"], {})
    assert [(s.id, s.url, s.dp_rank) for s in c.replica_specs()] == [
        ("10.0.0.5:30000-dp0", "http://10.0.0.5:30000", 0), ("10.0.0.5:30000-dp1", "http://10.0.0.5:30000", 1),
        ("10.0.0.6:30000-dp0", "http://10.0.0.6:30000", 0), ("10.0.0.6:30000-dp1", "http://10.0.0.6:30000", 1),
    ]  # fmt: skip
    env = load_config([], {"KVROUTE_REPLICAS": "http://10.0.0.5:30000", "KVROUTE_REPLICA_DP_RANKS": "3"})
    assert [s.id for s in env.replica_specs()] == [f"10.0.0.5:30000-dp{r}" for r in range(3)]
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="replica_dp_ranks"):
            load_config(["--replica", "http://10.0.0.5:30000", "--replica-dp-ranks", bad], {})
