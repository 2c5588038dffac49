"""Hugging Face model folders read and written slice by slice, so no rank ever holds the whole model.

Reading: each rank reads, with safetensors' slicing (`safe_open(...).get_slice`), only the part of each HF
tensor that its own shards of the model hold (the box DTensor reports for it), through the adapter's
`hf_layout` (a rename, experts split along dim 0, or rows permuted within heads, for which the whole heads
covering the box are read). Single files and index-sharded folders alike. On an object store (`folder` a URL)
the box's bytes are fetched with ranged GETs from the offsets in the file's header (SliceReader).

Writing (`save_hf_folder`): every rank casts its own slices to the export dtype and writes them, in parts of
at most PART_BYTES, under `<folder>/sharded/<file>/`; then torch's DCP consolidation
(torch.distributed.checkpoint._consolidate_hf_safetensors, what HuggingFaceStorageWriter uses) stitches the
parts of each output file, one tensor at a time, on the rank that owns that file. The output has
save_pretrained's layout: `model.safetensors`, or `model-0000i-of-0000n.safetensors` + the index when the
size limit splits it, with config.json, generation_config.json and the tokenizer files. Peak memory per
rank: its slices (1/N of the model) + one part + one whole tensor (consolidation), plus a constant. `folder`
may be an object store URL (tools/storage.py): the same steps run in a local scratch folder per rank,
with each rank uploading what it wrote (write_hf_weights).
"""

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.tools import storage
from torchtitan.protocols.state_dict_adapter import HFLayout, StateDictAdapter

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PART_BYTES = 64 * 2**20
"""A rank's slices are written in parts of at most this many bytes (plus one tensor): the constant of the
save's memory bound."""
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")


class HFFolderError(ValueError):
    """An HF folder that cannot be read or written; the message names the file and the fix."""


# ---- reading -----------------------------------------------------------------------------------------------


def weight_files(folder: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it, checked: the index's files exist, every file's
    header is readable and its tensors lie within the file (a truncated download is caught here)."""
    return {k: name for name, header in weight_headers(folder).items() for k in header}


def weight_headers(folder: str) -> dict[str, dict]:
    """Safetensors file name -> its header (tensor name -> dtype, shape, data_offsets), for every weights file
    of the folder (local or on a store: three small requests a file), checked as `weight_files` says."""
    index = storage.join(folder, INDEX)
    if storage.isfile(index):
        try:
            weight_map = json.loads(storage.read_bytes(index))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFFolderError(f"{index} is not a safetensors index (no weight_map): {e}") from e
        files = sorted(set(weight_map.values()))
    elif storage.isfile(storage.join(folder, SINGLE)):
        weight_map, files = None, [SINGLE]
    else:
        raise HFFolderError(f"{folder} holds no {SINGLE} and no {INDEX}: not a Hugging Face weights folder")
    headers: dict[str, dict] = {}
    for name in files:
        path = storage.join(folder, name)
        if not storage.isfile(path):
            raise HFFolderError(f"{index} names {name}, which is missing from {folder}: the download is incomplete")
        headers[name] = {k: v for k, v in _check_complete(path).items() if k != "__metadata__"}
    if weight_map is not None:
        found = {k: name for name, header in headers.items() for k in header}
        lost = sorted(k for k, name in weight_map.items() if found.get(k) != name)
        if lost:
            raise HFFolderError(f"{index} places {lost[0]} in {weight_map[lost[0]]}, which does not hold it")
    return headers


def _check_complete(path: str) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; the data starts at `__data_start__`,
    added here); refuses a file shorter than its header says (safetensors itself only notices when a tensor in
    the missing part is read, with a bus error under mmap). The format: an 8-byte little-endian header length,
    the JSON header, then the tensors' bytes, each at data_offsets from the end of the header."""
    try:
        n = int.from_bytes(storage.read_range(path, 0, 8), "little")
        header = json.loads(storage.read_range(path, 8, 8 + n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFFolderError(f"{path} is not a readable safetensors file ({type(e).__name__}); download it again") from e
    size = storage.size(path)
    if 8 + n + end > size:
        raise HFFolderError(
            f"{path} is truncated: its header describes {8 + n + end:,} bytes, the file has {size:,}; download it again"
        )
    for k, v in header.items():
        if k != "__metadata__":
            v["__data_start__"] = 8 + n
    return header


def weight_shapes(folder: str) -> dict[str, list[int]]:
    """HF tensor name -> shape, from the safetensors headers alone (no tensor is read), checked as in
    `weight_files`."""
    return {k: list(v["shape"]) for header in weight_headers(folder).values() for k, v in header.items()}


def check_weight_shapes(folder: str, adapter: StateDictAdapter, shapes: dict[str, torch.Size],
                        have: dict[str, list[int]] | None = None) -> None:
    """Every HF tensor that the model of `shapes` (our names -> global shapes) reads from `folder` is there
    with the shape the model needs, judged from the headers (`have`: weight_shapes(folder), when read already)
    as the adapter's reader presents them (`hf_reader`: e.g. GPT-OSS's MXFP4 block/scale pairs read as one
    tensor). Called once the folder's config.json matched the model (check_hf_config), so a difference here is
    a folder whose weights and config.json disagree: one line naming the tensor, both shapes and the fix."""
    reader = adapter.hf_reader(_HeaderShapes(folder, weight_shapes(folder) if have is None else have))
    for key, shape in shapes.items():
        layout = adapter.hf_layout(key, shape)
        if layout is None:
            continue
        want = hf_shape(layout, shape)
        for hf_key in layout.hf_keys:
            if hf_key not in reader.where:
                raise HFFolderError(
                    f"{folder} lacks the weight {hf_key} that its config.json implies: a checkpoint of another "
                    f"model or an incomplete folder; point --checkpoint.initial_load_path at the folder it belongs to"
                )
            if (got := list(reader.shape(hf_key))) != want:
                raise HFFolderError(
                    f"{folder}: {hf_key} is {got} in its safetensors, {want} by its config.json (the "
                    f"weights and config.json disagree); fix config.json, or point --checkpoint.initial_load_path "
                    f"at the folder these weights came from"
                )


class _HeaderShapes:
    """The `where` / `shape` of a SliceReader from shapes read off the headers (nothing opened again)."""

    def __init__(self, folder: str, shapes: dict[str, list[int]]):
        self.folder, self._shapes = folder, shapes
        self.where = dict.fromkeys(shapes, "")

    def shape(self, key: str) -> list[int]:
        return self._shapes[key]


class SliceReader:
    """Reads boxes of HF tensors from a folder's safetensors files, local or on an object store.

    Locally each read opens its file with safetensors and closes it again: safetensors maps the file, and pages
    a read touched stay in the process's RSS until the file is closed, so a long-open file would hold every
    slice read from it. On a store (`folder` a URL; torch's HuggingFaceStorageReader opens local files only)
    the box is read with ranged GETs from the offsets the header gives (`_read_box_ranges`): a rank fetches the
    bytes of its own box, not the file."""

    def __init__(self, folder: str):
        self.folder, self.remote = folder, storage.is_url(folder)
        self._headers = weight_headers(folder)
        self.where = {k: name for name, header in self._headers.items() for k in header}

    def shape(self, key: str) -> list[int]:
        return list(self._entry(key)["shape"])

    def read(self, key: str, offsets: Iterable[int], sizes: Iterable[int]) -> torch.Tensor:
        offsets, sizes = list(offsets), list(sizes)
        if self.remote:
            return _read_box_ranges(storage.join(self.folder, self.where[key]), self._entry(key), offsets, sizes)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        with safe_open(os.path.join(self.folder, self.where[key]), framework="pt") as f:
            return f.get_slice(key)[index].clone()  # a copy: the slice is a view of the mapped file

    def _entry(self, key: str) -> dict:
        if key not in self.where:
            raise HFFolderError(f"{self.folder} lacks the weight {key}: a checkpoint of another model?")
        return self._headers[self.where[key]][key]


# safetensors' dtype names (its format specification)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
    "U8": torch.uint8, "BOOL": torch.bool,
}

MERGE_GAP_BYTES = 1 << 20
"""Two byte runs of a box on a store are fetched by one ranged GET when at most this many unneeded bytes lie
between them: a request costs ~10-50 ms of latency, the time ~1-5 MB take at a stream's ~100 MB/s, so a smaller
gap is cheaper read than asked for separately (a box split along a later dim, e.g. tensor parallel's row-wise
weights, then reads its rows whole: up to TP times its share of those tensors, still 1/FSDP of each)."""


def _read_box_ranges(url: str, entry: dict, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """The box (offsets, sizes) of one safetensors tensor on a store, from ranged GETs of the runs of bytes the
    box covers (row-major: a run per index of the dims before the last partial one), runs closer than
    MERGE_GAP_BYTES fetched together, in parts of at most storage.PART_BYTES."""
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise HFFolderError(f"{url}: dtype {entry['dtype']} is not one torch reads")
    dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], list(entry["shape"])
    item = torch.empty((), dtype=dtype).element_size()
    base = entry["__data_start__"] + entry["data_offsets"][0]
    if math.prod(sizes) == 0:
        return torch.empty(sizes, dtype=dtype)
    box = list(sizes)
    if not shape:  # a scalar
        shape, offsets, sizes = [1], [0], [1]
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    # k: the dim before which the box takes one run of bytes per index (every dim after k is spanned whole)
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    run = sizes[k] * strides[k]
    starts = torch.tensor(offsets[k] * strides[k], dtype=torch.int64)
    for d in range(k):
        starts = starts.unsqueeze(-1) + torch.arange(offsets[d], offsets[d] + sizes[d]) * strides[d]
    starts = starts.reshape(-1)
    gaps = (starts[1:] - starts[:-1] - run) * item
    cuts = [0, *((gaps > MERGE_GAP_BYTES).nonzero().flatten() + 1).tolist(), len(starts)]
    groups = [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    ranges = []  # (first byte, end byte) of each part of each group
    for a, b in groups:
        lo, hi = base + int(starts[a]) * item, base + (int(starts[b - 1]) + run) * item
        ranges += [(p, min(p + storage.PART_BYTES, hi)) for p in range(lo, hi, storage.PART_BYTES)]
    parts = iter(storage.read_ranges(url, ranges))
    out = torch.empty(len(starts), run, dtype=dtype)
    within = torch.arange(run)
    for a, b in groups:
        lo, hi = base + int(starts[a]) * item, base + (int(starts[b - 1]) + run) * item
        blob = bytearray()
        while len(blob) < hi - lo:
            blob += next(parts)
        flat = torch.frombuffer(blob, dtype=torch.uint8).view(dtype)
        out[a:b] = flat[(starts[a:b] - starts[a]).unsqueeze(1) + within]
    return out.view(box)


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int], bool]:
    """(this rank's local tensor, its offsets and sizes in the global tensor, whether this rank is the one
    that writes it: the first of the ranks replicating it)."""
    if not isinstance(t, DTensor):
        return t, [0] * t.dim(), list(t.shape), True
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coordinate = t.device_mesh.get_coordinate() or []
    owner = all(c == 0 for c, p in zip(coordinate, t.placements) if isinstance(p, Replicate))
    return t.to_local(), list(offsets), list(sizes), owner


def read_box(reader: SliceReader, layout: HFLayout, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """The box (offsets, sizes) of our tensor laid out as `layout`, read slice by slice."""
    if layout.stacked:
        return torch.stack([reader.read(layout.hf_keys[e], offsets[1:], sizes[1:])
                            for e in range(offsets[0], offsets[0] + sizes[0])])
    key = layout.hf_keys[0]
    if layout.hf_rows:  # our tensor is a row range of the HF one
        return reader.read(key, [offsets[0] + layout.row_offset, *offsets[1:]], sizes)
    if not layout.row_block:
        return reader.read(key, offsets, sizes)
    b = layout.row_block
    r0, r1 = offsets[0] // b * b, -(-(offsets[0] + sizes[0]) // b) * b  # the whole blocks covering the box
    slab = layout.from_hf_rows(reader.read(key, [r0, *offsets[1:]], [r1 - r0, *sizes[1:]]))
    return slab[offsets[0] - r0 : offsets[0] - r0 + sizes[0]]


def hf_shape(layout: HFLayout, shape: torch.Size) -> list[int]:
    if layout.hf_rows:
        return [layout.hf_rows, *shape[1:]]
    return list(shape[1:]) if layout.stacked else list(shape)


def load_hf_into(state_dict: dict[str, torch.Tensor], folder: str, adapter: StateDictAdapter) -> None:
    """Fills `state_dict` (our names; plain tensors or DTensors, e.g. get_model_state_dict of FSDP/TP model
    parts) in place from an HF folder, each rank reading only its boxes. Shapes are checked first, in one
    line naming the tensor."""
    reader = adapter.hf_reader(SliceReader(folder))
    check_weight_shapes(folder, adapter, {k: t.shape for k, t in state_dict.items()})
    plans = [(key, t, layout) for key, t in state_dict.items() if (layout := adapter.hf_layout(key, t.shape))]
    with torch.no_grad():
        for key, t, layout in plans:
            local, offsets, sizes, _ = local_box(t)
            if local.numel():
                local.copy_(read_box(reader, layout, offsets, sizes).to(local.dtype))


def load_hf_folder(folder: str, adapter_cls: type[StateDictAdapter], expected=None) -> tuple[dict[str, torch.Tensor], object]:
    """(every tensor under our names, the folder's args), one process. With `expected` (the args the job
    trains), the folder's config is compared with them first (StateDictAdapter.check_hf_config)."""
    args = adapter_cls.args_from_hf(folder)
    if expected is not None:
        adapter_cls.check_hf_config(folder, args, expected)
    return read_hf_state_dict(folder, adapter_cls, args), args


def read_hf_state_dict(folder: str, adapter_cls: type[StateDictAdapter], args) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder under our names (one process; for conversion to DCP). A tied model's
    folder stores no lm_head.weight: the adapter's from_hf fills our output from the embedding."""
    adapter = adapter_cls(args)
    reader = adapter.hf_reader(SliceReader(folder))
    full = {k: reader.read(k, [0] * len(reader.shape(k)), reader.shape(k)) for k in reader.where}
    return adapter.from_hf(full)


# ---- writing -----------------------------------------------------------------------------------------------


def _natural(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def plan_files(shapes: dict[str, list[int]], dtype: torch.dtype, max_shard_bytes: int) -> dict[str, str]:
    """HF tensor -> output file name, filling files in name order up to max_shard_bytes (a larger tensor
    gets a file of its own), named as save_pretrained names them."""
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
    groups: list[list[str]] = [[]]
    used = 0
    for key in sorted(shapes, key=_natural):
        n = math.prod(shapes[key]) * size
        if groups[-1] and used + n > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += n
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SINGLE)
    total = len(groups)
    return {k: f"model-{i:05d}-of-{total:05d}.safetensors" for i, g in enumerate(groups, 1) for k in g}


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _PartWriter:
    """Writes one rank's slices for each output file into parts under sharded/<file>/, PART_BYTES at a time,
    with the offsets DCP's consolidation reads (DCP_SHARDING_INFO)."""

    def __init__(self, sharded: str, files: dict[str, str], tag: str):
        self.sharded, self.files, self.tag = sharded, files, tag
        self.pending: dict[str, dict[str, tuple[torch.Tensor, list[int]]]] = {}
        self.bytes, self.count = 0, 0

    def add(self, key: str, tensor: torch.Tensor, offsets: list[int]) -> None:
        if key in self.pending.get(self.files[key], {}):
            self.flush()  # another piece of the same HF tensor (a fused one, see HFLayout.hf_rows): its own part
        self.pending.setdefault(self.files[key], {})[key] = (tensor.contiguous(), offsets)
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= PART_BYTES:
            self.flush()

    def flush(self) -> None:
        for name, tensors in self.pending.items():
            folder = os.path.join(self.sharded, name)
            os.makedirs(folder, exist_ok=True)
            info = {k: {"saved_offsets": off} for k, (_, off) in tensors.items()}
            save_file({k: t for k, (t, _) in tensors.items()}, os.path.join(folder, f"{self.tag}-{self.count}.safetensors"),
                      metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})
            self.count += 1
        self.pending, self.bytes = {}, 0


def hf_chunks(adapter: StateDictAdapter, key: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, list[int]]]:
    """(HF name, this rank's slice in HF layout, its offsets) for our tensor `t`, for the ranks that write
    it. A rows-permuted tensor whose slices do not hold whole blocks is gathered first (a collective over
    its mesh, taken by every rank of it) and written by its first rank."""
    layout = adapter.hf_layout(key, t.shape)
    if layout is None:
        local = t.to_local() if isinstance(t, DTensor) else t
        adapter.to_hf({key: local})  # lets the adapter refuse a state HF cannot hold (e.g. a moved router bias)
        return
    local, offsets, sizes, owner = local_box(t)
    if layout.row_block and isinstance(t, DTensor) and not _blocks_whole(t, layout.row_block):
        local, offsets, sizes = t.full_tensor(), [0] * t.dim(), list(t.shape)
        owner = all(c == 0 for c in (t.device_mesh.get_coordinate() or []))
    if not owner or local.numel() == 0:
        return
    if layout.stacked:
        for i, e in enumerate(range(offsets[0], offsets[0] + sizes[0])):
            yield layout.hf_keys[e], local[i], offsets[1:]
    elif layout.row_block:
        yield layout.hf_keys[0], layout.to_hf_rows(local), offsets
    elif layout.hf_rows:
        yield layout.hf_keys[0], local, [offsets[0] + layout.row_offset, *offsets[1:]]
    else:
        yield layout.hf_keys[0], local, offsets
        for hf_key in layout.copies:  # its own storage: safetensors refuses tensors sharing memory
            yield hf_key, local.clone(), offsets


def _blocks_whole(t: DTensor, block: int) -> bool:
    """Whether every rank's slice of dim 0 is a whole number of `block` rows (the same answer on every rank:
    it depends on the global shape and placements only)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh_shape = list(t.device_mesh.shape)
    for flat in range(math.prod(mesh_shape)):
        coordinate = []
        for n in reversed(mesh_shape):
            coordinate.insert(0, flat % n)
            flat //= n
        sizes, offsets = _compute_local_shape_and_global_offset(t.shape, mesh_shape, coordinate, t.placements)
        if offsets[0] % block or sizes[0] % block:
            return False
    return True


def check_output_folder(folder: str) -> None:
    if storage.is_url(folder):
        if storage.listdir(folder):
            raise HFFolderError(f"{folder} exists and is not empty; choose another output folder or remove it")
        return
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise HFFolderError(f"{folder} exists and is not empty; choose another output folder or remove it")


def write_hf_weights(
    chunks: Iterable[tuple[str, torch.Tensor, list[int]]],
    shapes: dict[str, list[int]],
    folder: str,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Writes HF tensors of global `shapes` (every rank passes the same dict) from this rank's `chunks`
    (HF name, slice, offsets) into `folder` as save_pretrained lays them out; collective when a process
    group exists. Returns the safetensors file names. On an object store (`folder` a URL) each rank works in
    a local scratch folder: it uploads its own parts, the rank that stitches an output file downloads that
    file's parts, stitches them locally and uploads the result (per-rank traffic: its slices + its files)."""
    rank, world = _rank_world()
    files = plan_files(shapes, dtype, max_shard_bytes)
    remote = storage.is_url(folder)
    work = tempfile.mkdtemp(prefix="torchtitan-hf-") if remote else folder
    try:
        sharded = os.path.join(work, "sharded")
        writer = _PartWriter(sharded, files, f"rank{rank:05d}")
        for key, t, offsets in chunks:
            writer.add(key, t.detach().to(device="cpu", dtype=dtype), offsets)
        writer.flush()
        if remote and os.path.isdir(sharded):
            upload_files(sharded, storage.join(folder, "sharded"))
        if dist.is_initialized():
            dist.barrier()
        names = sorted(set(files.values()))
        for i, name in enumerate(names):
            if i % world == rank:  # each output file is stitched by one rank, one tensor at a time
                mapping = {k: name for k, f in files.items() if f == name}
                if remote:
                    shutil.rmtree(os.path.join(sharded, name), ignore_errors=True)
                    storage.copy_out(storage.join(folder, "sharded", name), os.path.join(sharded, name))
                _consolidate_safetensors_files(os.path.join(sharded, name), work, mapping, num_threads=1)
                if remote:
                    storage.upload_file(os.path.join(work, name), storage.join(folder, name))
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            if remote:
                storage.remove_tree(storage.join(folder, "sharded"))
            else:
                shutil.rmtree(sharded)
            if len(names) > 1:
                size = torch.finfo(dtype).bits // 8
                total = sum(math.prod(s) * size for s in shapes.values())
                index = {"metadata": {"total_size": total},
                         "weight_map": {k: files[k] for k in sorted(files, key=_natural)}}
                storage.write_bytes(storage.join(folder, INDEX), json.dumps(index, indent=2).encode("utf-8"))
    finally:
        if remote:
            shutil.rmtree(work, ignore_errors=True)
    return names


def model_hf_shapes(adapter: StateDictAdapter, state_dict: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Global shape of every HF tensor the model's state dict maps to, gathered over all ranks (pipeline
    stages hold different keys)."""
    shapes = {}
    for key, t in state_dict.items():
        layout = adapter.hf_layout(key, t.shape)
        if layout is not None:
            shapes.update({k: hf_shape(layout, t.shape) for k in (*layout.hf_keys, *layout.copies)})
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, shapes)
        shapes = {k: v for part in every for k, v in part.items()}
    return shapes


def save_hf_folder(
    state_dict: dict[str, torch.Tensor],
    adapter_cls: type[StateDictAdapter],
    args,
    folder: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer=None,
) -> None:
    """Writes a model's state dict (our names; plain tensors, or this rank's DTensor shards under FSDP/TP/EP,
    every rank calling) as a Hub-ready Hugging Face folder: safetensors split at max_shard_bytes (+ index),
    config.json, generation_config.json and, given the project `tokenizer`, its Hugging Face files. `folder`
    must be new or empty. No rank gathers the model (see the module docstring)."""
    rank, _ = _rank_world()
    adapter = adapter_cls(args)
    check_output_folder(folder)
    config = adapter_cls.to_hf_config(args, dtype)  # refuses an args the HF architecture cannot express, early
    shapes = model_hf_shapes(adapter, state_dict)
    if rank == 0:
        storage.makedirs(folder)
    if dist.is_initialized():
        dist.barrier()
    chunks = (c for key, t in state_dict.items() for c in hf_chunks(adapter, key, t))
    write_hf_weights(chunks, shapes, folder, dtype, max_shard_bytes)
    if rank == 0:
        write_hf_metadata(folder, config, tokenizer)


def write_hf_metadata(folder: str, config: dict, tokenizer=None) -> None:
    """config.json, generation_config.json and (given a project tokenizer) the tokenizer files; config.json
    last (a folder with it is complete). On a store they are written in a local scratch folder and uploaded."""
    if storage.is_url(folder):
        with tempfile.TemporaryDirectory(prefix="torchtitan-hf-") as work:
            _write_hf_metadata(work, config, tokenizer)
            upload_files(work, folder, last="config.json")
        return
    _write_hf_metadata(folder, config, tokenizer)


def upload_files(local: str, url: str, last: str | None = None) -> None:
    """Uploads every file under a local folder to the same names under `url`, the file named `last` last (the
    one whose presence marks the folder complete)."""
    for rel in sorted(storage.file_sizes(local), key=lambda n: (n == last, n)):
        storage.upload_file(os.path.join(local, rel), storage.join(url, *rel.split(os.sep)))


def _write_hf_metadata(folder: str, config: dict, tokenizer=None) -> None:
    from torchtitan.components.tokenizer.hf_export import save_hf_tokenizer

    if tokenizer is not None:
        config = {**config, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        save_hf_tokenizer(tokenizer, folder)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:  # last: a folder with config.json is complete
        json.dump(config, f, indent=2)
