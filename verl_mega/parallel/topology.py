"""Parse the text printed by ``nvidia-smi topo -m`` into a typed per-node topology.

Everything here is a pure function over text, so recorded outputs from any machine can be tested on a laptop.
The parser accepts what real drivers print: tab- or space-separated cells (tabs expanded by copy/paste), NIC
columns named ``NIC#`` (with the ``NIC Legend`` mapping them to ``mlx5_*``) or named by device (older drivers),
``CPU Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID`` columns (any subset, cells possibly empty) and ANSI colour
escapes. A token it does not know is an error that names the line and column, never a silent guess.
"""

from __future__ import annotations

import enum
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import combinations

__all__ = [
    "LinkKind",
    "Link",
    "Device",
    "NodeTopology",
    "TopologyParseError",
    "TopologyUnavailableError",
    "parse_topology",
    "parse_cpu_list",
    "read_local_topology_text",
]


class TopologyParseError(ValueError):
    """The text is not a ``nvidia-smi topo -m`` matrix this parser understands."""


class TopologyUnavailableError(RuntimeError):
    """``nvidia-smi`` cannot be run on this machine."""


class LinkKind(enum.Enum):
    SELF = "X"
    NVLINK = "NV"
    PIX = "PIX"  # at most one PCIe bridge
    PXB = "PXB"  # several PCIe bridges, no host bridge
    PHB = "PHB"  # through a PCIe host bridge (the CPU)
    NODE = "NODE"  # between host bridges inside one NUMA node
    SYS = "SYS"  # across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)


# Higher is faster. NVLink ranks above every PCIe path and grows with the number of bonded links, so NV18 > NV12.
_PCIE_RANK = {LinkKind.PIX: 50, LinkKind.PXB: 40, LinkKind.PHB: 30, LinkKind.NODE: 20, LinkKind.SYS: 10}
_NVLINK_BASE_RANK = 100
_SELF_RANK = 10_000

_CLASS_NAMES = {
    LinkKind.SELF: "same device",
    LinkKind.NVLINK: "NVLink",
    LinkKind.PIX: "PCIe switch",
    LinkKind.PXB: "PCIe multi-switch",
    LinkKind.PHB: "PCIe host bridge",
    LinkKind.NODE: "PCIe within NUMA node",
    LinkKind.SYS: "cross-socket (SMP interconnect)",
}


@dataclass(frozen=True)
class Link:
    """One cell of the matrix: the path between two devices."""

    kind: LinkKind
    nvlinks: int = 0  # number of bonded NVLinks for NV#, else 0

    @property
    def bandwidth_rank(self) -> int:
        """Orderable speed class: larger is faster (X > NV# by bond count > PIX > PXB > PHB > NODE > SYS)."""
        if self.kind is LinkKind.SELF:
            return _SELF_RANK
        if self.kind is LinkKind.NVLINK:
            return _NVLINK_BASE_RANK + self.nvlinks
        return _PCIE_RANK[self.kind]

    @property
    def is_nvlink(self) -> bool:
        return self.kind is LinkKind.NVLINK

    @property
    def label(self) -> str:
        return f"NV{self.nvlinks}" if self.kind is LinkKind.NVLINK else self.kind.value

    @property
    def bandwidth_class(self) -> str:
        return _CLASS_NAMES[self.kind]

    def __str__(self) -> str:
        return self.label


_NV_RE = re.compile(r"^NV(\d+)$")
_FIXED_LINKS = {k.value: Link(k) for k in LinkKind if k is not LinkKind.NVLINK}
_FIXED_LINKS["SOC"] = Link(LinkKind.SYS)  # drivers before ~R384 printed SOC for the socket-level path


def _parse_link(token: str) -> Link | None:
    if token in _FIXED_LINKS:
        return _FIXED_LINKS[token]
    m = _NV_RE.match(token)
    if m and int(m.group(1)) > 0:
        return Link(LinkKind.NVLINK, int(m.group(1)))
    return None


@dataclass(frozen=True)
class Device:
    """A row/column of the matrix: a GPU or a NIC."""

    name: str  # as printed: GPU3, NIC0, or mlx5_0 on older drivers
    is_gpu: bool
    index: int  # position among devices of the same kind
    alias: str | None = None  # NIC legend name (mlx5_0); None for GPUs or when no legend was printed
    cpu_affinity: tuple[int, ...] | None = None
    numa_affinity: tuple[int, ...] | None = None
    gpu_numa_id: int | None = None

    @property
    def display_name(self) -> str:
        return self.alias or self.name


@dataclass(frozen=True)
class NodeTopology:
    """The parsed matrix of one node. Indices are local GPU ordinals as nvidia-smi numbers them."""

    gpus: tuple[Device, ...]
    nics: tuple[Device, ...]
    gpu_links: tuple[tuple[Link, ...], ...]  # [gpu][gpu]
    gpu_nic_links: tuple[tuple[Link, ...], ...]  # [gpu][nic]
    hostname: str | None = None

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def link(self, gpu_a: int, gpu_b: int) -> Link:
        return self.gpu_links[gpu_a][gpu_b]

    def numa_node(self, gpu: int) -> int | None:
        """The GPU's NUMA node (first entry of NUMA Affinity), or None if the driver did not say."""
        numa = self.gpus[gpu].numa_affinity
        return numa[0] if numa else None

    def nearest_nic(self, gpu: int) -> Device | None:
        """The NIC with the best PCIe path to ``gpu`` (ties: lowest index); None on a box without NICs."""
        if not self.nics:
            return None
        row = self.gpu_nic_links[gpu]
        best = max(range(len(self.nics)), key=lambda j: (row[j].bandwidth_rank, -j))
        return self.nics[best]

    def worst_link(self, gpus: tuple[int, ...] | list[int]) -> Link:
        """The slowest pairwise link among ``gpus`` (the bottleneck of a collective over them)."""
        if len(gpus) < 2:
            return Link(LinkKind.SELF)
        return min((self.gpu_links[a][b] for a, b in combinations(gpus, 2)), key=lambda ln: ln.bandwidth_rank)

    @cached_property
    def nvlink_islands(self) -> tuple[tuple[int, ...], ...]:
        """Partition of the GPUs into fully NVLink-connected sets (cliques), largest and best-bonded first.

        A GPU without NVLink is its own island. Connected NVLink components that are not cliques (e.g. the
        DGX-1 hybrid cube-mesh) are split into cliques, preferring the largest clique with the strongest bonds.
        """
        n = self.num_gpus
        adj = [{b for b in range(n) if b != a and self.gpu_links[a][b].is_nvlink} for a in range(n)]
        islands: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for start in range(n):
            if start in seen:
                continue
            comp, stack = set(), [start]
            while stack:
                g = stack.pop()
                if g not in comp:
                    comp.add(g)
                    stack.extend(adj[g] - comp)
            seen |= comp
            islands.extend(self._split_into_cliques(comp, adj))
        return tuple(sorted(islands, key=lambda isl: (-len(isl), isl[0])))

    def _split_into_cliques(self, comp: set[int], adj: list[set[int]]) -> list[tuple[int, ...]]:
        remaining = set(comp)
        out = []
        while remaining:
            cliques = _maximal_cliques(remaining, adj)

            def quality(c: frozenset[int]) -> tuple[int, int, int]:
                ranks = [self.gpu_links[a][b].bandwidth_rank for a, b in combinations(sorted(c), 2)]
                return (len(c), min(ranks, default=0), -min(c))

            best = max(cliques, key=quality)
            out.append(tuple(sorted(best)))
            remaining -= best
        return out

    def subset(self, gpus: list[int]) -> "NodeTopology":
        """The topology of ``gpus`` only (e.g. the CUDA_VISIBLE_DEVICES of a shared node), renumbered 0..k-1."""
        if list(gpus) == list(range(self.num_gpus)):
            return self
        if any(not 0 <= g < self.num_gpus for g in gpus):
            raise TopologyParseError(f"GPUs {list(gpus)} are not all among the topology's {self.num_gpus} GPUs")
        return NodeTopology(gpus=tuple(replace(self.gpus[g], index=i, name=f"GPU{i}") for i, g in enumerate(gpus)),
                            nics=self.nics, gpu_links=tuple(tuple(self.gpu_links[a][b] for b in gpus) for a in gpus),
                            gpu_nic_links=tuple(self.gpu_nic_links[g] for g in gpus), hostname=self.hostname)

    def signature(self) -> tuple:
        """Hashable summary of everything placement depends on; equal signatures give equal placements."""
        return (
            tuple(tuple(ln.label for ln in row) for row in self.gpu_links),
            tuple(self.numa_node(g) for g in range(self.num_gpus)),
        )


def _maximal_cliques(nodes: set[int], adj: list[set[int]]) -> list[frozenset[int]]:
    """Bron-Kerbosch with pivoting over the subgraph induced by ``nodes`` (a node has at most a few dozen GPUs)."""
    out: list[frozenset[int]] = []

    def expand(r: set[int], p: set[int], x: set[int]) -> None:
        if not p and not x:
            out.append(frozenset(r))
            return
        pivot = max(p | x, key=lambda u: len(adj[u] & p))
        for v in sorted(p - adj[pivot]):
            expand(r | {v}, p & adj[v], x & adj[v])
            p = p - {v}
            x = x | {v}

    expand(set(), set(nodes), set())
    return out


# ----------------------------------------------------------------------------------------------------------------
# Text parsing
# ----------------------------------------------------------------------------------------------------------------

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
# Header spellings users paste from real machines and guides: "CPU Affinity", "CPU_Affinity", a bare "Affinity"
# (older drivers), "NUMA Affinity", "NUMA Node", a bare "NUMA", "GPU NUMA ID"; any case, spaces or underscores.
_AFFINITY_RE = re.compile(r"(?i)\bGPU[\s_]+NUMA[\s_]+ID\b|\bCPU[\s_]+Affinity\b|\bNUMA(?:[\s_]+(?:Affinity|Node))?\b|"
                          r"\bAffinity\b")


def _affinity_name(text: str) -> str:
    key = re.sub(r"[\s_]+", " ", text).upper()
    if key.startswith("GPU"):
        return "GPU NUMA ID"
    return "NUMA Affinity" if key.startswith("NUMA") else "CPU Affinity"
_GPU_RE = re.compile(r"^GPU(\d+)$")
_NIC_RE = re.compile(r"^NIC(\d+)$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]*$")
_LEGEND_NIC_RE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


@dataclass(frozen=True)
class _Token:
    text: str
    column: int  # 1-based column in the original line


class _Identity:
    """Index map of a line that needed no cleaning."""

    def __getitem__(self, i: int) -> int:
        return i


def _clean_line(raw: str) -> tuple[str, list[int] | _Identity]:
    """Drop ANSI escapes and CR; return the clean line and, per clean character, its 0-based raw index."""
    if "\x1b" not in raw and "\r" not in raw:
        return raw, _Identity()
    keep: list[int] = []
    out: list[str] = []
    pos = 0
    for m in [*_ANSI_RE.finditer(raw), None]:
        end = len(raw) if m is None else m.start()
        for i in range(pos, end):
            if raw[i] != "\r":
                keep.append(i)
                out.append(raw[i])
        if m is not None:
            pos = m.end()
    return "".join(out), keep


def parse_cpu_list(text: str) -> tuple[int, ...] | None:
    """``"0-23,48-71"`` -> (0, ..., 23, 48, ..., 71); ``"N/A"`` or empty -> None."""
    text = text.strip()
    if not text or text.upper() == "N/A":
        return None
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()):
                raise ValueError(f"bad CPU/NUMA list {text!r}")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"bad CPU/NUMA list {text!r}")
    return tuple(out)


def _err(line_no: int, column: int, msg: str) -> TopologyParseError:
    return TopologyParseError(f"nvidia-smi topo -m, line {line_no}, column {column}: {msg}")


def _parse_header(line: str, index_map, line_no: int) -> tuple[list[str], list[str]]:
    """Return (device column names, affinity column names) of the header line."""
    devices: list[str] = []
    affinity: list[str] = []
    pos = 0
    spans = [(m.start(), m.end(), _affinity_name(m.group(0))) for m in _AFFINITY_RE.finditer(line)]
    chunks: list[tuple[str, int]] = []
    for s, e, name in spans:
        chunks.extend((m.group(0), pos + m.start()) for m in re.finditer(r"\S+", line[pos:s]))
        chunks.append((name, s))
        pos = e
    chunks.extend((m.group(0), pos + m.start()) for m in re.finditer(r"\S+", line[pos:]))
    for text, start in chunks:
        col = index_map[start] + 1
        if text in _AFFINITY_COLUMNS:
            affinity.append(text)
        elif affinity:
            raise _err(line_no, col, f"unexpected header column {text!r} after the affinity columns")
        elif _DEVICE_NAME_RE.match(text):
            devices.append(text)
        else:
            raise _err(line_no, col, f"unexpected header column {text!r}")
    gpu_cols = [d for d in devices if _GPU_RE.match(d)]
    if [int(_GPU_RE.match(d).group(1)) for d in gpu_cols] != list(range(len(gpu_cols))):
        raise _err(line_no, 1, f"GPU columns must be GPU0..GPU{len(gpu_cols) - 1} in order, got {gpu_cols}")
    if devices[: len(gpu_cols)] != gpu_cols:
        raise _err(line_no, 1, "GPU columns must come before NIC columns")
    return devices, affinity


def _is_header(line: str) -> bool:
    stripped = _AFFINITY_RE.sub(" ", line).split()
    return bool(stripped) and stripped[0] == "GPU0" and "X" not in stripped


def _assign_affinity(
    raw_fields: list[str] | None, tokens: list[_Token], columns: list[str], line_no: int, row: str
) -> dict[str, str]:
    """Map the trailing cells of a GPU row onto the affinity columns.

    nvidia-smi pads these cells with tabs that do not line up with the header, and leaves a cell empty when the
    value is unknown (e.g. no CPU affinity inside a container). When fewer values than columns are present, the
    missing one is the leading CPU Affinity if the tab-separated row shows an empty first cell, else values are
    right-aligned (GPU NUMA ID is always printed last).
    """
    values = [t.text for t in tokens]
    if len(values) > len(columns):
        extra = tokens[len(columns)]
        raise _err(line_no, extra.column, f"row {row} has {len(values)} affinity values for {len(columns)} "
                   f"affinity columns ({', '.join(columns)}): {extra.text!r} is unexpected")
    if len(values) == len(columns):
        return dict(zip(columns, values))
    if raw_fields is not None and raw_fields and raw_fields[0].strip() and values:
        return {columns[0]: values[0], **dict(zip(columns[len(columns) - len(values) + 1:], values[1:]))}
    return dict(zip(columns[len(columns) - len(values):], values))


def parse_topology(text: str, *, hostname: str | None = None) -> NodeTopology:
    """Parse one node's ``nvidia-smi topo -m`` output. Raises TopologyParseError naming line and column."""
    raw_lines = text.splitlines()
    cleaned = [_clean_line(raw) for raw in raw_lines]
    header_idx = next((i for i, (ln, _) in enumerate(cleaned) if _is_header(ln)), None)
    if header_idx is None:
        raise TopologyParseError(
            "no `nvidia-smi topo -m` matrix found: expected a header line listing GPU0, GPU1, ... "
            "(pass the unmodified output of `nvidia-smi topo -m`)"
        )
    header_line, header_map = cleaned[header_idx]
    columns, affinity_cols = _parse_header(header_line, header_map, header_idx + 1)
    n_cols = len(columns)
    n_gpus = sum(1 for c in columns if _GPU_RE.match(c))

    rows: dict[str, tuple[list[Link], dict[str, str], int]] = {}
    i = header_idx + 1
    while i < len(cleaned):
        line, index_map = cleaned[i]
        line_no = i + 1
        if not line.strip() or line.strip().startswith("Legend"):
            break
        toks = [_Token(m.group(0), index_map[m.start()] + 1) for m in re.finditer(r"\S+", line)]
        label = toks[0]
        if label.text not in columns:
            raise _err(line_no, label.column, f"row label {label.text!r} is not one of the header columns")
        if label.text in rows:
            raise _err(line_no, label.column, f"row {label.text} appears twice")
        cells = toks[1 : 1 + n_cols]
        links: list[Link] = []
        for j, tok in enumerate(cells):
            link = _parse_link(tok.text)
            if link is None:
                raise _err(line_no, tok.column, f"unknown link token {tok.text!r} in row {label.text}, column "
                           f"{columns[j]} (expected X, NV#, PIX, PXB, PHB, NODE or SYS)")
            links.append(link)
        if len(links) < n_cols:
            end_col = (cells[-1].column + len(cells[-1].text)) if cells else label.column + len(label.text)
            raise _err(line_no, end_col, f"row {label.text} has {len(links)} link cells, expected {n_cols}")
        row_pos = columns.index(label.text)
        for j, link in enumerate(links):
            if (j == row_pos) != (link.kind is LinkKind.SELF):
                tok = cells[j]
                raise _err(line_no, tok.column, f"row {label.text}, column {columns[j]}: 'X' must appear exactly "
                           f"on the diagonal, found {tok.text!r}")
        affinity: dict[str, str] = {}
        trailing = toks[1 + n_cols:]
        if _GPU_RE.match(label.text):
            raw_fields = None
            if "\t" in line:
                raw_fields = line.split("\t")[1 + n_cols:]
            affinity = _assign_affinity(raw_fields, trailing, affinity_cols, line_no, label.text)
        elif trailing:
            raise _err(line_no, trailing[0].column, f"unexpected value {trailing[0].text!r} after the link cells "
                       f"of NIC row {label.text}")
        rows[label.text] = (links, affinity, line_no)
        i += 1

    missing = [c for c in columns[:n_gpus] if c not in rows]
    if missing:
        raise TopologyParseError(f"nvidia-smi topo -m: the matrix has no row for {', '.join(missing)} "
                                 f"(is the output truncated?)")

    legend: dict[str, str] = {}
    for line, _ in cleaned[i:]:
        m = _LEGEND_NIC_RE.match(line)
        if m:
            legend[m.group(1)] = m.group(2)

    gpu_names = columns[:n_gpus]
    nic_names = columns[n_gpus:]
    gpus = []
    for g, name in enumerate(gpu_names):
        links, aff, line_no = rows[name]
        try:
            cpu = parse_cpu_list(aff.get("CPU Affinity", ""))
            numa = parse_cpu_list(aff.get("NUMA Affinity", ""))
        except ValueError as exc:
            raise TopologyParseError(f"nvidia-smi topo -m, line {line_no}: {exc} in row {name}") from None
        gnid = aff.get("GPU NUMA ID", "N/A")
        gpus.append(Device(name=name, is_gpu=True, index=g, cpu_affinity=cpu, numa_affinity=numa,
                           gpu_numa_id=int(gnid) if gnid.isdigit() else None))
    nics = []
    for k, name in enumerate(nic_names):
        alias = legend.get(name) if _NIC_RE.match(name) else name
        nics.append(Device(name=name, is_gpu=False, index=k, alias=alias))

    gpu_links = tuple(tuple(rows[a][0][:n_gpus]) for a in gpu_names)
    for a in range(n_gpus):
        for b in range(a + 1, n_gpus):
            if gpu_links[a][b] != gpu_links[b][a]:
                raise TopologyParseError(
                    f"nvidia-smi topo -m, line {rows[gpu_names[a]][2]}: GPU{a}<->GPU{b} is "
                    f"{gpu_links[a][b]} but GPU{b}<->GPU{a} (line {rows[gpu_names[b]][2]}) is {gpu_links[b][a]}; "
                    f"the matrix must be symmetric"
                )
    gpu_nic = tuple(tuple(rows[a][0][n_gpus:]) for a in gpu_names)
    return NodeTopology(gpus=tuple(gpus), nics=tuple(nics), gpu_links=gpu_links, gpu_nic_links=gpu_nic,
                        hostname=hostname)


def read_local_topology_text(timeout_s: float = 60.0) -> str:
    """Run ``nvidia-smi topo -m`` here and return its output."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise TopologyUnavailableError(
            "nvidia-smi is not on PATH: run on a machine with the NVIDIA driver installed, or pass a saved "
            "`nvidia-smi topo -m` output with --file"
        )
    proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise TopologyUnavailableError(
            f"`nvidia-smi topo -m` failed with exit code {proc.returncode}: "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def parse_gpu_uuids(text: str) -> dict[str, int]:
    """GPU UUID → nvidia-smi index, from ``nvidia-smi --query-gpu=index,uuid --format=csv,noheader``."""
    out = {}
    for line in text.splitlines():
        index, _, uuid = line.partition(",")
        if index.strip().isdigit() and uuid.strip():
            out[uuid.strip()] = int(index)
    return out


def read_gpu_uuids(timeout_s: float = 60.0) -> dict[str, int]:
    """This machine's GPU UUIDs and their nvidia-smi indices ({} when nvidia-smi cannot tell)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    proc = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    return parse_gpu_uuids(proc.stdout) if proc.returncode == 0 else {}
