"""The trainer's ledger of prompt groups survives a restart exactly as it was written."""

from __future__ import annotations

import json
from pathlib import Path

from services.trainer.ledger import LEDGER_FILE, GroupLedger
from shared.schemas import PromptGroup


def group(i: int) -> PromptGroup:
    return PromptGroup(id=f"g{i}", task="addition", prompt=f"{i}+1=", answer=str(i + 1), samples=2)


def test_ledger_reloads_what_it_recorded(tmp_path: Path) -> None:
    ledger = GroupLedger.in_dir(tmp_path, "r")
    assert not ledger.existed
    ledger._append([{"submitted": [group(i).model_dump() for i in range(5)]}])
    ledger._append([{"withdrawn": ["g4"]}])
    ledger.settle_trained(["g0", "g1"], version=1)
    ledger.settle_dead(["g2"])
    ledger.settle_dead(["g2"])  # recorded once
    with (tmp_path / LEDGER_FILE).open("a") as f:
        f.write('{"trained": ["g3"')  # a crash mid-write: that write never returned

    again = GroupLedger.in_dir(tmp_path, "r")
    assert again.existed and again.epoch == ledger.epoch
    assert again.trained == {"g0", "g1"} and again.dead == {"g2"}
    assert [g.id for g in again.unsettled(held=set())] == ["g3"]
    assert again.unsettled(held={"g3"}) == []
    assert sum(1 for line in (tmp_path / LEDGER_FILE).read_text().splitlines() if '"dead"' in line) == 1


def test_a_data_dir_reused_for_another_run_starts_a_new_ledger(tmp_path: Path) -> None:
    old = GroupLedger.in_dir(tmp_path, "first")
    old._append([{"submitted": [group(0).model_dump()]}])
    new = GroupLedger.in_dir(tmp_path, "second")
    assert not new.existed and new.unsettled(set()) == [] and new.epoch != old.epoch
    kept = tmp_path / f"{LEDGER_FILE}.first"
    assert json.loads(kept.read_text().splitlines()[1])["submitted"][0]["id"] == "g0"


def test_the_ledger_is_compacted_to_what_it_says(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Withdrawn groups and trained groups' prompts drop out once the file has doubled past the
    threshold; what reloads is unchanged, and the file stays bounded by the live state."""
    monkeypatch.setattr("services.trainer.ledger.COMPACT_FROM_BYTES", 4096)
    ledger = GroupLedger.in_dir(tmp_path, "r")
    path = tmp_path / LEDGER_FILE
    peak = 0
    for step in range(40):
        batch = [group(1000 * step + i) for i in range(8)]
        ledger._append([{"submitted": [g.model_dump() for g in batch]}])
        ledger.open.update((g.id, g) for g in batch)
        ledger._append([{"withdrawn": [batch[-1].id]}])  # as a queue refusal after its room check
        ledger.open.pop(batch[-1].id)
        ledger.settle_trained([g.id for g in batch[:6]], version=step + 1)
        peak = max(peak, path.stat().st_size)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum("withdrawn" in row for row in rows) < 40  # the older ones compacted away
    assert peak < 4 * 4096 + 8192  # never far past twice the compacted size
    again = GroupLedger.in_dir(tmp_path, "r")
    assert again.epoch == ledger.epoch and again.trained == ledger.trained
    assert again.last_version == 40 and set(again.open) == set(ledger.open) == {
        f"g{1000 * s + 6}" for s in range(40)}
