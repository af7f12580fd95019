"""Every region file, Kubernetes manifest and systemd unit in deploy/ parses, names only flags
and settings the feeder accepts, and the per-region variants differ only where regions do."""
from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
import yaml

from feeder.cli import build_parser
from feeder.ops.cli_serve import serve_config
from feeder.core.config import ServeConfig
from feeder.core.errors import InvalidArgument
from feeder.ops.regions import load_region

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
REGIONS = ("us-east", "eu-west", "ap-south")


def feeder_args(argv: list[str]):
    """argv after the `feeder` program name, parsed by the real CLI (a SystemExit is a flag
    the feeder does not accept)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the feeder does not accept: feeder {shlex.join(argv)}")


def region_configs(directory: Path, monkeypatch) -> dict[str, dict]:
    monkeypatch.setenv("FEEDER_LOCAL", "/srv/feeder-local")
    out = {}
    for name in REGIONS:
        values = load_region(str(directory / f"{name}.toml"))
        values.pop("cursor_secret_file", None)   # what serve reads it into:
        ServeConfig(**values, cursor_secret=b"k")  # every value valid
        out[name] = values
    return out


def same_but_region(configs: dict[str, dict]) -> None:
    """Settings equal across regions once the region's own name is factored out; peers are
    exactly the other regions."""
    def norm(name, values):
        return {k: v.replace(name, "REGION") if isinstance(v, str) else v for k, v in values.items() if k != "peers"}

    base = norm("us-east", configs["us-east"])
    for name, values in configs.items():
        assert values["region"] == name
        assert norm(name, values) == base, f"{name} differs from us-east beyond its name"
        assert {p for p, _ in values["peers"]} == set(REGIONS) - {name}


def test_region_files_load_and_differ_only_by_region(monkeypatch):
    configs = region_configs(DEPLOY / "regions", monkeypatch)
    same_but_region(configs)
    for values in configs.values():  # production: beyond loopback, so TLS and tokens on
        assert values["tls_cert"] and values["tls_client_ca"] and values["tokens_file"]
        assert not values.get("insecure")


def test_local_regions_each_have_a_port_and_a_replica(monkeypatch):
    configs = region_configs(DEPLOY / "local", monkeypatch)
    ports = {c["listen"].rpartition(":")[2] for c in configs.values()}
    assert len(ports) == 3
    sources = {c["source"] for c in configs.values()}
    assert sources == {f"/srv/feeder-local/{r}/dataset" for r in REGIONS}
    for name, c in configs.items():
        assert c["listen"].startswith("127.0.0.1:")  # loopback: plain text allowed
        assert dict(c["peers"]) == {p: configs[p]["listen"] for p in REGIONS if p != name}


def test_command_line_overrides_the_region_file(monkeypatch, tmp_path):
    monkeypatch.setenv("FEEDER_LOCAL", str(tmp_path))
    args = feeder_args(["serve", "--config", str(DEPLOY / "local" / "eu-west.toml"), "--listen", "127.0.0.1:0",
                        "--compression", "none"])
    cfg = serve_config(args)
    assert (cfg.region, cfg.listen, cfg.default_compression) == ("eu-west", "127.0.0.1:0", "none")
    assert cfg.source == str(tmp_path / "eu-west" / "dataset") and cfg.message_bytes == 262144

    bad = tmp_path / "bad.toml"
    bad.write_text('region = "x"\nsource = "d"\n[stream]\nprefetch = 3\n')
    with pytest.raises(InvalidArgument, match=r"stream\.prefetch is not a setting; expected one of .*prefetch_messages"):
        load_region(str(bad))
    bad.write_text('source = "${NOT_SET_ANYWHERE}/x"\n')
    with pytest.raises(InvalidArgument, match="NOT_SET_ANYWHERE, which is not set"):
        load_region(str(bad))
    bad.write_text('source = "rel/shards"\n')
    assert load_region(str(bad))["source"] == str(tmp_path / "rel" / "shards")


def load_yaml(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} is empty"
    return docs


def test_kubernetes_base(monkeypatch):
    base = DEPLOY / "k8s" / "base"
    kust = load_yaml(base / "kustomization.yaml")[0]
    objs = {d["kind"]: d for r in kust["resources"] for d in load_yaml(base / r)}
    assert set(objs) == {"Deployment", "Service", "PodDisruptionBudget"}
    dep = objs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = feeder_args(c["args"])
    assert args.command == "serve" and args.config
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert Path(args.config).parent.as_posix() in mounts  # the region file is mounted
    volumes = {v["name"] for v in pod["volumes"]}
    assert set(mounts.values()) <= volumes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[0] == "feeder"
        p = feeder_args(cmd[1:])
        assert p.command == "health" and p.config == args.config  # grpc.health.v1, over TLS
    req = c["resources"]["requests"]
    assert req["cpu"] and req["memory"] and c["resources"]["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] > 30  # more than the feeders' drain (grace_s)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    svc = objs["Service"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    pdb = objs["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"]


def test_kubernetes_overlays_differ_only_where_regions_differ(monkeypatch):
    base = DEPLOY / "k8s" / "base"
    dep = load_yaml(base / "deployment.yaml")[0]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    configs, texts = {}, {}
    for name in REGIONS:
        d = DEPLOY / "k8s" / "overlays" / name
        kust = load_yaml(d / "kustomization.yaml")[0]
        assert kust["resources"] == ["../../base"] and kust["namespace"] == f"feeder-{name}"
        (gen,) = kust["configMapGenerator"]
        assert gen["name"] == "feeder-region" and gen["files"] == ["region.toml"]
        for patch in kust.get("patches", []):
            (p,) = load_yaml(d / patch["path"])
            assert (p["kind"], p["metadata"]["name"]) == (dep["kind"], dep["metadata"]["name"])
            names = {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
            assert {v["name"] for v in p["spec"]["template"]["spec"]["volumes"]} <= names
            assert f"/{name}/" in p["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"]
        values = load_region(str(d / "region.toml"))
        secret = values.pop("cursor_secret_file")
        ServeConfig(**values, cursor_secret=b"k")
        configs[name] = values
        # Everything the feeder reads is where the base mounts it; it listens where the pod's ports are.
        for path in (values["source"], values["tls_cert"], values["tls_key"], values["tls_client_ca"],
                     values["tls_ca"], values["tokens_file"], secret):
            assert any(path == m or path.startswith(m + "/") for m in mounts), f"{name}: {path} is not mounted"
        assert int(values["listen"].rpartition(":")[2]) == ports["grpc"]
        assert int(values["metrics_listen"].rpartition(":")[2]) == ports["metrics"]
        texts[name] = {f.name: f.read_text().replace(name, "REGION") for f in d.iterdir() if f.name != "region.toml"}
    same_but_region(configs)
    assert texts["eu-west"] == texts["us-east"] == texts["ap-south"]


def unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, strict=False)
    cp.optionxform = str
    cp.read_string(path.read_text())
    return cp


def test_systemd_units(monkeypatch):
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {u.name for u in units} >= {"feeder@.service", "feeder-health@.service"}
    for u in units:
        cp = unit(u)
        exe, *argv = shlex.split(cp["Service"]["ExecStart"])
        if exe.endswith("/feeder"):
            args = feeder_args([a.replace("%i", "us-east") for a in argv])
            # The unit reads /etc/feeder/regions/<region>.toml: what deploy/regions/ installs.
            assert Path(args.config).name == "us-east.toml" and (DEPLOY / "regions" / "us-east.toml").exists()
    main = unit(DEPLOY / "systemd" / "feeder@.service")
    assert main["Unit"]["RequiresMountsFor"] == "/lustre"
    assert main["Service"]["KillSignal"] == "SIGTERM" and main["Service"]["Restart"] == "on-failure"
    timer = unit(DEPLOY / "systemd" / "feeder-health@.timer")
    assert timer["Timer"]["Unit"] == "feeder-health@%i.service"
    assert "lfs setstripe" in (DEPLOY / "systemd" / "LUSTRE.md").read_text()


def test_a_region_file_can_ask_for_several_processes(tmp_path):
    region = tmp_path / "big.toml"
    region.write_text((DEPLOY / "regions" / "us-east.toml").read_text().replace('region = "us-east"',
                                                                               'region = "us-east"\nprocesses = 4'))
    values = load_region(str(region))
    values.pop("cursor_secret_file")
    assert ServeConfig(**values, cursor_secret=b"k").processes == 4
    region.write_text('source = "d"\nprocesses = 0\n')
    with pytest.raises(InvalidArgument, match="processes must be a positive integer, got 0"):
        ServeConfig(**load_region(str(region)))


def test_the_test_broker_never_draws_a_cluster_id_its_storage_tool_takes_for_an_option(monkeypatch):
    # One url-safe base64 id in 64 starts with '-'; the storage tool then failed with
    # "--cluster-id: expected one argument" and took the whole suite down with it.
    import importlib.util
    import uuid

    spec = importlib.util.spec_from_file_location("broker", DEPLOY / "kafka" / "broker.py")
    broker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(broker)
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x07" * 16)])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(draws))
    cluster = broker._cluster_id()
    assert not cluster.startswith("-") and len(cluster) == 22
    assert next(draws, None) is None  # the first, dashed draw was thrown away
