"""Router settings: worker specs, flags, environment variables and the TOML config file."""

from __future__ import annotations

import pytest

from router_svc.workers import WorkerAddress
from router_svc.config import parse_config


def test_worker_spec_parses_name_kind_host_and_port():
    assert WorkerAddress.parse("gpu-0=gpu@10.1.2.3:50062") == WorkerAddress("gpu-0", "gpu", "10.1.2.3", 50062)
    assert WorkerAddress.parse("cpu=cpu@[::1]:50061").address == "[::1]:50061"


@pytest.mark.parametrize("spec", ["cpu@h:1", "a=tpu@h:1", "a=cpu@h", "a=cpu@h:99999", "=cpu@h:1", "a=cpu@:1"])
def test_bad_worker_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="NAME=KIND@HOST:PORT"):
        WorkerAddress.parse(spec)


def test_flags_environment_and_config_file_in_that_order(tmp_path, monkeypatch):
    config = tmp_path / "router.toml"
    config.write_text('policy = "finish_time"\nport = 6000\nprobe_deadline_ms = 20\n'
                      'workers = ["c=cpu@127.0.0.1:1", "g=gpu@127.0.0.1:2"]\n')
    from_file = parse_config(["--config", str(config)])
    assert (from_file.policy, from_file.port, from_file.probe_deadline_ms) == ("finish_time", 6000, 20)
    assert [w.name for w in from_file.workers] == ["c", "g"]

    monkeypatch.setenv("TANDEM_PORT", "7000")
    monkeypatch.setenv("TANDEM_WORKERS", "x=cpu@127.0.0.1:3, y=gpu@127.0.0.1:4")
    from_env = parse_config(["--config", str(config)])
    assert from_env.port == 7000 and [w.name for w in from_env.workers] == ["x", "y"]

    from_flags = parse_config(["--config", str(config), "--port", "8000", "--policy", "cost",
                               "--worker", "z=gpu@127.0.0.1:5"])
    assert (from_flags.port, from_flags.policy, [w.name for w in from_flags.workers]) == (8000, "cost", ["z"])


def test_any_number_of_workers(monkeypatch):
    monkeypatch.delenv("TANDEM_WORKERS", raising=False)
    args = [arg for i in range(12) for arg in ("--worker", f"w{i}={'gpu' if i % 3 == 0 else 'cpu'}@127.0.0.1:{7000 + i}")]
    assert len(parse_config(args).workers) == 12


@pytest.mark.parametrize(("argv", "named"), [
    ([], "--worker"), (["--worker", "a=cpu@h:1", "--policy", "fastest"], "--policy"), (["--worker", "bad"], "bad"),
    (["--worker", "a=cpu@h:1", "--worker-keepalive-s", "0.5"], "worker_keepalive_s"),
])
def test_invalid_settings_exit_with_a_message_naming_the_setting(argv, named, monkeypatch, capsys):
    monkeypatch.delenv("TANDEM_WORKERS", raising=False)
    with pytest.raises(SystemExit):
        parse_config(argv)
    error = capsys.readouterr().err
    assert "error" in error and named in error
