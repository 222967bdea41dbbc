"""The committed stubs in relayrl/v1 are exactly what protoc generates from proto/relayrl/v1."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto_files(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto/relayrl/v1").glob("*.proto"))
    assert protos, "no .proto files found"
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    args += [f"--pyi_out={tmp_path}", *[str(ROOT / p) for p in protos]]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "relayrl/v1").iterdir())
    stubs = [p for p in (ROOT / "relayrl/v1").iterdir() if p.is_file() and p.name != "__init__.py"]
    committed = sorted(p.relative_to(ROOT) for p in stubs)
    assert [str(p) for p in generated] == [str(p) for p in committed]
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stubs differ from proto/ (run `make proto`): {stale}"
