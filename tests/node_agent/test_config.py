import json
from pathlib import Path

import pytest

from flatcake.node_agent.config import EngineConfig

pytestmark = pytest.mark.unit


def test_round_trip_through_json(tmp_path: Path) -> None:
    cfg = EngineConfig.from_dict(
        {
            "layers": 8,
            "page_bytes": 8192,
            "ssd": {"file_count": 3, "dir": "/x"},
            "io": {"gap_bytes": 0},
            "placement": {"agent_reply_tokens": 10},
        }
    )
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert EngineConfig.load(path) == cfg
    assert cfg.placement.agent_reply_tokens == 10 and cfg.ssd.file_count == 3


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"page_bytes": 1000}, "page_bytes"),
        ({"layers": 0}, "layers"),
        ({"ssd": {"file_count": "3"}}, r"ssd.file_count: '3' is not of type int"),
        ({"ssd": {"high_watermark": 0.5, "low_watermark": 0.7}}, "low_watermark"),
        ({"io": {"backend": "spdk"}}, "io.backend"),
        ({"io": {"workerz": 2}}, r"io.: unknown field\(s\) \['workerz'\]"),
        ({"io": {"staging_slot_bytes": 4096}, "page_bytes": 8192}, "staging_slot_bytes"),
        ({"node_id": 5000}, "node_id"),
        ({"ssd": {"file_bytes": 4096}}, "ssd.file_bytes"),
        ({"dram": 5}, "dram.: expected a mapping"),
    ],
)
def test_errors_name_the_field(data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(data)


def test_the_crd_offers_exactly_the_vocabularies_the_agent_accepts() -> None:
    """Each setting's vocabulary is defined once (node_agent/constants.py); the CRD's enums must match."""
    import yaml

    from flatcake.node_agent import constants as C
    from tests.support import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "flatcakecaches.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert tuple(spec["dram"]["properties"]["hugepageSize"]["enum"]) == C.HUGEPAGE_SIZES
    assert tuple(spec["io"]["properties"]["backend"]["enum"]) == C.IO_BACKENDS
