"""ServeConfig from files, the environment and flags; the `serve` subcommand's parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdclient import BreakerSettings, ConversationSettings, PDConfigError, PDOptions, RetrySettings
from pdclient.cli import build_parser, main
from pdclient.cli.serve import config_from_args
from pdclient.serve import SETTINGS, ServeConfig

P, D1, D2 = "http://p:8100/v1", "http://d1:8200/v1", "http://d2:8200/v1"
NO_ENV: dict[str, str] = {}


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in {s.env for s in SETTINGS if s.env} | {"PDCLIENT_SERVE_CONFIG"}:
        monkeypatch.delenv(name, raising=False)


def test_flags() -> None:
    config = parse(
        "--prefill", P, "--decode", D1, D2, "--port", "9000", "--api-key", "a", "--api-key", "b",
        "--on-prefill-failure", "fail", "--routing", "round_robin", "--prefill-timeout", "none",
        "--breaker-failures", "5", "--forward-api-key", "--log-format", "json", "--workers", "2",
    )  # fmt: skip
    options = config.options
    assert options.prefill_urls == (P,) and options.decode_urls == (D1, D2)
    assert config.port == 9000 and config.api_keys == ("a", "b") and config.workers == 2
    assert options.on_prefill_failure == "fail" and options.routing == "round_robin"
    assert options.breaker == BreakerSettings(failures=5, cooldown=5.0)
    assert options.retries == RetrySettings(prefill_timeout=None)
    assert config.forward_api_key is True and config.log_format == "json"


def test_conversation_flags_reach_the_options() -> None:
    config = parse(
        "--prefill", P, "--decode", D1, "--remote-prefill", "auto",
        "--conversation-threshold-tokens", "512", "--conversation-max-uncached-ratio", "0.5",
        "--conversation-block-size", "16",
    )  # fmt: skip
    assert config.options.remote_prefill == "auto"
    assert config.options.conversations == ConversationSettings(
        threshold_tokens=512, max_uncached_ratio=0.5, block_size=16
    )


def test_the_stall_budget_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    default = parse("--prefill", P, "--decode", D1).options.conversations
    assert (default.max_decode_stall_share, default.max_decode_stall_ms) == (0.1, None)
    assert default.threshold_tokens is None
    assert default.stall_budget_ms(5000.0) == 500.0  # a tenth of the streams' answer time
    config = parse("--prefill", P, "--decode", D1, "--max-decode-stall-ms", "40")
    assert config.options.conversations.max_decode_stall_ms == 40.0
    assert config.options.conversations.stall_budget_ms(5000.0) == 40.0  # a fixed budget wins
    config = parse("--prefill", P, "--decode", D1, "--max-decode-stall-share", "0.25")
    assert config.options.conversations.stall_budget_ms(5000.0) == 1250.0
    monkeypatch.setenv("PDCLIENT_SERVE_MAX_DECODE_STALL_MS", "0")
    assert parse("--prefill", P, "--decode", D1).options.conversations.max_decode_stall_ms == 0.0
    monkeypatch.setenv("PDCLIENT_SERVE_MAX_DECODE_STALL_MS", "none")
    monkeypatch.setenv("PDCLIENT_SERVE_MAX_DECODE_STALL_SHARE", "0")
    assert parse("--prefill", P, "--decode", D1).options.conversations.stall_budget_ms(5000.0) == 0.0
    capped = parse("--prefill", P, "--decode", D1, "--conversation-threshold-tokens", "none")
    assert capped.options.conversations.threshold_tokens is None


def test_dispatch_flag_and_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--prefill", P, "--decode", D1).options.dispatch == "sequential"
    assert parse("--prefill", P, "--decode", D1, "--dispatch", "concurrent").options.dispatch == "concurrent"
    monkeypatch.setenv("PDCLIENT_SERVE_DISPATCH", "auto")
    assert parse("--prefill", P, "--decode", D1).options.dispatch == "auto"
    assert parse("--prefill", P, "--decode", D1, "--dispatch", "sequential").options.dispatch == "sequential"
    with pytest.raises(SystemExit):
        parse("--prefill", P, "--decode", D1, "--dispatch", "parallel")
    assert "invalid choice: 'parallel'" in capsys.readouterr().err


def test_a_switch_on_by_default_has_its_no_form() -> None:
    assert parse("--prefill", P, "--decode", D1).options.conversations.warm_prefill is True
    config = parse("--prefill", P, "--decode", D1, "--no-conversation-warm-prefill", "--remote-prefill", "always")
    assert config.options.conversations.warm_prefill is False and config.options.remote_prefill == "always"


def test_defaults_are_the_clients() -> None:
    config = parse("--prefill", P, "--decode", D1)
    assert (config.host, config.port, config.workers, config.grace_period) == ("127.0.0.1", 8000, 1, 30.0)
    assert config.options == PDOptions(prefill_base_url=P, decode_base_url=D1)
    assert config.api_keys == () and not config.forward_api_key and config.upstream_api_key is None


def test_environment_gives_urls_and_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", P)
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", f"{D1}, {D2}")
    monkeypatch.setenv("PDCLIENT_SERVE_API_KEYS", "k1,k2")
    config = parse()
    assert config.options.prefill_urls == (P,) and config.options.decode_urls == (D1, D2)
    assert config.api_keys == ("k1", "k2")
    assert parse("--decode", D2).options.decode_urls == (D2,)  # a flag wins over the environment


def test_every_setting_is_also_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$PDCLIENT_SERVE_<NAME>`` for each, but the names the library itself reads."""
    own = {"prefill": "PDCLIENT_PREFILL_BASE_URL", "decode": "PDCLIENT_DECODE_BASE_URL"}
    own["reuse_secret"] = "PDCLIENT_REUSE_SECRET"
    for setting in SETTINGS:
        assert setting.env == own.get(setting.name, f"PDCLIENT_SERVE_{setting.name.upper()}"), setting.name
    for name, value in {
        "PDCLIENT_PREFILL_BASE_URL": P,
        "PDCLIENT_DECODE_BASE_URL": D1,
        "PDCLIENT_SERVE_PORT": "9100",
        "PDCLIENT_SERVE_HOST": "0.0.0.0",
        "PDCLIENT_SERVE_WORKERS": "3",
        "PDCLIENT_SERVE_LOG_FORMAT": "json",
        "PDCLIENT_SERVE_TRACE_HEADERS": "on",
        "PDCLIENT_SERVE_BREAKER_FAILURES": "7",
        "PDCLIENT_SERVE_ROUTING": "round_robin",
        "PDCLIENT_SERVE_CONVERSATION_WARM_PREFILL": "off",
    }.items():
        monkeypatch.setenv(name, value)
    config = parse()
    assert (config.port, config.host, config.workers, config.log_format) == (9100, "0.0.0.0", 3, "json")
    assert config.trace_headers is True and config.options.breaker.failures == 7
    assert config.options.routing == "round_robin" and config.options.conversations.warm_prefill is False
    assert parse("--port", "9200", "--no-conversation-warm-prefill").port == 9200  # flags win
    monkeypatch.setenv("PDCLIENT_SERVE_WORKERS", "zero")
    with pytest.raises(PDConfigError, match=r"^\$PDCLIENT_SERVE_WORKERS: expected an integer"):  # as it was given
        parse()


def test_the_config_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "serve.json"
    file.write_text(json.dumps({"prefill": [P], "decode": [D1], "port": 7000}))
    monkeypatch.setenv("PDCLIENT_SERVE_CONFIG", str(file))
    assert parse().port == 7000
    monkeypatch.setenv("PDCLIENT_SERVE_PORT", "7001")
    assert parse().port == 7001  # file < environment


def test_each_routing_flag_offers_only_what_it_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--prefill", P, "--decode", D1, "--prefill-routing", "cache_aware").options.prefill_routing
    for flag in ("--routing", "--decode-routing"):
        with pytest.raises(SystemExit):
            parse("--prefill", P, "--decode", D1, flag, "cache_aware")
        assert "invalid choice: 'cache_aware'" in capsys.readouterr().err
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    routing_help = help_text.split("--routing ", 1)[1].split("\n", 1)[0]
    assert "cache_aware" not in routing_help and "least_outstanding" in routing_help


def test_the_worker_variable_is_not_a_setting() -> None:
    from pdclient.serve._config import CONFIG_ENV

    assert CONFIG_ENV.startswith("_") and CONFIG_ENV not in {s.env for s in SETTINGS}


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    settings = {"prefill": [P], "decode": [D1], "port": 7000, "breaker-cooldown": 2.5, "prefill_timeout": 30}
    file = tmp_path / f"serve{suffix}"
    if suffix == ".toml":
        file.write_text(
            f'prefill = ["{P}"]\ndecode = ["{D1}"]\nport = 7000\nbreaker-cooldown = 2.5\nprefill_timeout = 30\n'
        )
    else:
        file.write_text(json.dumps(settings))
    config = parse("--config", str(file))
    assert config.options.prefill_urls == (P,) and config.port == 7000
    assert config.options.breaker.cooldown == 2.5 and config.options.retries.prefill_timeout == 30.0
    # file < environment < flags
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", D2)
    assert parse("--config", str(file)).options.decode_urls == (D2,)
    assert parse("--config", str(file), "--port", "7001").port == 7001


def test_every_setting_has_a_flag_and_every_option_a_setting() -> None:
    import dataclasses

    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for setting in SETTINGS:
        assert setting.option in help_text and setting.help
    # The client options are PDOptions's: each field (a nested one's fields) is a setting,
    # unless it has no command-line form or the proxy sets it (allow_call_overrides: from a
    # setting of its own, off by default).
    paths = {s.path[1:] for s in SETTINGS if s.path[0] == "options"}
    for f in dataclasses.fields(PDOptions):
        if f.name in ("on_trace", "observers", "allow_call_fallback_url", "allow_call_overrides"):
            continue
        if f.name in ("breaker", "retries", "conversations"):
            nested = {"breaker": BreakerSettings, "retries": RetrySettings}.get(f.name, ConversationSettings)
            assert {(f.name, c.name) for c in dataclasses.fields(nested)} <= paths
        else:
            assert (f.name,) in paths, f.name
    own = {s.path[0] for s in SETTINGS if s.path[0] != "options"}
    assert own == {f.name for f in dataclasses.fields(ServeConfig)} - {"options"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decode": [D1]}, "prefill: give at least one URL"),
        ({"prefill": [P], "decode": [D1], "colour": "red"}, "unknown setting 'colour'"),
        ({"prefill": [P], "decode": [D1], "port": "eighty"}, "port: expected an integer"),
        ({"prefill": [P], "decode": [D1], "routing": "random"}, "routing must be one of"),
        ({"prefill": [P], "decode": ["ftp://x"]}, "is not an http(s) URL"),
        ({"prefill": [P], "decode": [D1], "on_prefill_failure": "retry"}, "on_prefill_failure must be one of"),
        ({"prefill": [P], "decode": [D1], "prefill_attempts": 0}, "retries.prefill_attempts must be an int >= 1"),
        ({"prefill": [P], "decode": [D1, D1]}, "lists the same URL twice"),
        ({"prefill": [P], "decode": [D1], "forward_api_key": True, "upstream_api_key": "k"}, "not both"),
        ({"prefill": [P], "decode": [D1], "workers": 0}, "workers must be at least 1"),
        ({"prefill": [P], "decode": [D1], "remote_prefill": "maybe"}, "remote_prefill must be one of"),
        (
            {"prefill": [P], "decode": [D1], "conversation_max_uncached_ratio": 2},
            "conversations.max_uncached_ratio must be in",
        ),
    ],
)
def test_bad_settings_are_one_clear_error(settings: dict, message: str) -> None:
    with pytest.raises(PDConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServeConfig.from_mapping(settings)


def test_bad_config_file(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text("prefill = [")
    with pytest.raises(PDConfigError, match="config file"):
        ServeConfig.load(file, NO_ENV)
    with pytest.raises(PDConfigError, match="No such file"):
        ServeConfig.load(tmp_path / "missing.json", NO_ENV)


def test_json_round_trip_for_workers() -> None:
    options = PDOptions(prefill_base_url=P, decode_base_url=[D1, D2], retries=RetrySettings(prefill_timeout=None))
    config = ServeConfig(options=options, api_keys=("k",), port=0)
    assert ServeConfig.from_json(config.to_json()) == config
    with pytest.raises(PDConfigError, match="worker processes"):
        ServeConfig(options=options.replace(on_trace=print)).to_json()


def test_cli_reports_config_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--prefill", P]) == 1
    assert capsys.readouterr().err.strip() == (
        "pdclient serve: error: decode: give at least one URL (--decode, or $PDCLIENT_DECODE_BASE_URL)"
    )


def test_fleet_flags_reach_the_options_and_the_workers() -> None:
    from pdclient.fleet import HealthSettings

    config = parse(
        "--prefill", P, "--decode", D1, D2, "--prefill-routing", "cache_aware", "--decode-routing", "load_aware",
        "--health-checks", "on", "--load-signals", "auto",
    )  # fmt: skip
    options = config.options
    assert options.policy_for("prefill") == "cache_aware" and options.policy_for("decode") == "load_aware"
    assert options.health_checks == HealthSettings() and options.discovery is None
    assert ServeConfig.from_json(config.to_json()) == config
    tuned = ServeConfig(options=config.options.replace(health_checks=HealthSettings(interval=1.0)))
    with pytest.raises(PDConfigError, match=r"health_checks=.*worker processes"):
        tuned.to_json()


# -- a key setting must hold a key ---------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "argv", "named"),
    [
        ({"PDCLIENT_SERVE_API_KEYS": " , "}, (), "PDCLIENT_SERVE_API_KEYS"),
        ({"PDCLIENT_SERVE_API_KEYS": ""}, (), "PDCLIENT_SERVE_API_KEYS"),  # a Secret whose value is empty
        ({}, ("--api-key", ""), "--api-key"),
        ({}, ("--api-key", "k1", "--api-key", " "), "--api-key"),
        ({"PDCLIENT_SERVE_UPSTREAM_API_KEY": ""}, (), "PDCLIENT_SERVE_UPSTREAM_API_KEY"),
        ({}, ("--upstream-api-key", " "), "--upstream-api-key"),
        ({"PDCLIENT_REUSE_SECRET": ""}, (), "PDCLIENT_REUSE_SECRET"),
        ({}, ("--reuse-secret", ""), "--reuse-secret"),
    ],
)
def test_a_key_setting_without_a_key_is_an_error_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str], argv: tuple, named: str
) -> None:
    """Not a proxy that starts with /v1 open, nor legs sent unsigned."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((PDConfigError, SystemExit)) as excinfo:  # SystemExit: argparse refused the flag's value
        parse("--prefill", P, "--decode", D1, *argv)
    message = str(excinfo.value) if isinstance(excinfo.value, PDConfigError) else capsys.readouterr().err
    assert named in message and "empty" in message, message


@pytest.mark.parametrize("keys", [[], [""], ["k1", " "], " , "])
def test_a_config_file_key_setting_without_a_key_is_an_error(tmp_path: Path, keys: object) -> None:
    file = tmp_path / "serve.json"
    file.write_text(json.dumps({"prefill": [P], "decode": [D1], "api_keys": keys}))
    with pytest.raises(PDConfigError, match=f"config file {file}: api_keys"):
        ServeConfig.load(file, NO_ENV)


def test_no_key_setting_at_all_still_means_no_keys_and_workers_get_the_same() -> None:
    config = ServeConfig.load(None, {"PDCLIENT_PREFILL_BASE_URL": P, "PDCLIENT_DECODE_BASE_URL": D1})
    assert config.api_keys == () and config.upstream_api_key is None
    assert ServeConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("field", [{"api_keys": ("k1", "")}, {"upstream_api_key": ""}])
def test_a_config_built_in_code_refuses_an_empty_key(field: dict[str, object]) -> None:
    with pytest.raises(PDConfigError, match=next(iter(field))):
        ServeConfig(options=PDOptions(prefill_base_url=P, decode_base_url=D1), **field)  # type: ignore[arg-type]


# -- durations: finite, not negative -------------------------------------------------------

DURATIONS = [s for s in SETTINGS if s.metavar == "SECONDS"]


def test_the_duration_settings_are_known() -> None:
    names = {s.name for s in DURATIONS}
    assert names == {
        "breaker_cooldown",
        "backoff_initial",
        "backoff_max",
        "prefill_timeout",
        "timeout",
        "connect_timeout",
        "grace_period",
        "header_timeout",
        "body_timeout",
        "keep_alive_timeout",
    }


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "NaN"])
@pytest.mark.parametrize("setting", DURATIONS, ids=lambda s: s.name)
def test_every_duration_setting_refuses_nan_infinity_and_negatives(setting: object, value: str) -> None:
    name = setting.name  # type: ignore[attr-defined]
    with pytest.raises(PDConfigError, match=f"{setting.path[-1]} must be a finite number of seconds"):  # type: ignore[attr-defined]
        ServeConfig.from_mapping({"prefill": [P], "decode": [D1], name: value})


def test_a_nan_grace_period_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to start, and on SIGTERM exit at once, cutting the streams it should drain."""
    message = "grace_period must be a finite number of seconds >= 0, got nan"
    with pytest.raises(PDConfigError, match=message):
        parse("--prefill", P, "--decode", D1, "--grace-period", "nan")
    monkeypatch.setenv("PDCLIENT_SERVE_GRACE_PERIOD", "nan")
    with pytest.raises(PDConfigError, match=message):
        parse("--prefill", P, "--decode", D1)
    assert parse("--prefill", P, "--decode", D1, "--grace-period", "0").grace_period == 0.0  # no drain: allowed


def test_kv_events_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("--prefill", P, "--decode", D1).options.kv_events is None
    assert parse("--prefill", P, "--decode", D1, "--kv-events", "discover").options.kv_events == "discover"
    assert parse("--prefill", P, "--decode", D1, "--kv-events", "5557").options.kv_events == "tcp://{host}:5557"
    both = "tcp://{host}:5557,tcp://{host}:5558"
    assert parse("--prefill", P, "--decode", D1, "--kv-events", both).options.kv_events == both
    monkeypatch.setenv("PDCLIENT_SERVE_KV_EVENTS", "off")
    assert parse("--prefill", P, "--decode", D1).options.kv_events is None
    with pytest.raises(PDConfigError, match="kv_events"):
        parse("--prefill", P, "--decode", D1, "--kv-events", "udp://{host}:1")
