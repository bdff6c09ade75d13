"""A fleet engine's torch.distributed world of one listens on loopback only, not on every interface."""

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# vLLM's external launcher starts the engine's world exactly so: env:// init, then gloo groups of its own
WORLD = """
import json, os
import torch, torch.distributed as dist
from verl_mega.rollout.fleet_engine import private_world

world, env = private_world()
os.environ.update(env)
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(2)
dist.all_reduce(t, group=dist.new_group(backend="gloo"))
assert t.tolist() == [1.0, 1.0]
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
listening = []
for table in ("tcp", "tcp6"):
    for row in open(f"/proc/self/net/{table}").read().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN, one of this process's sockets
            listening.append(fields[1].split(":")[0])
print(json.dumps({"listening": listening, "env": env}))
"""


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def test_address_decoding():
    assert str(_address("0100007F")) == "127.0.0.1"
    assert str(_address("00000000000000000000000000000000")) == "::"
    assert str(_address("00000000000000000000000001000000")) == "::1"


def test_the_engine_world_listens_on_loopback_only():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", WORLD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    addresses = [_address(a) for a in report["listening"]]
    assert len(addresses) >= 2, addresses  # the store, and gloo's pair
    assert all(a.is_loopback for a in addresses), addresses
    assert report["env"]["MASTER_ADDR"] == "127.0.0.1" and report["env"]["GLOO_SOCKET_IFNAME"] == "lo"
