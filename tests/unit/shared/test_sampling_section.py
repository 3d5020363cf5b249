"""How rollouts are sampled is one section, `sampling` (shared.sampling.SamplingSettings), with one
default for the trainer and the workers (they must agree: shared.agreement); set by
SPARSECAST_SAMPLING__*, the flat SPARSECAST_TEMPERATURE / SPARSECAST_TOP_P deprecated aliases."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from shared.agreement import sampling_mismatch
from shared.sampling import FLAT_SAMPLING_NAMES, SamplingSettings
from shared.schemas import SamplingInfo
from shared.settings_help import settings_rows

SERVICES = [TrainerSettings, RolloutSettings]


pytestmark = pytest.mark.usefixtures("clean_settings_env")


def test_one_default_for_trainer_and_workers() -> None:
    assert SamplingSettings() == SamplingSettings(temperature=1.0, top_p=1.0)
    for settings in SERVICES:
        assert settings().sampling == SamplingSettings()
        assert not {"temperature", "top_p"} & set(settings.model_fields)
        assert {flat: settings.flat_aliases[flat] for flat in FLAT_SAMPLING_NAMES} == FLAT_SAMPLING_NAMES
    # Defaults agree with each other by construction: a default worker's samples train.
    drawn = RolloutSettings().sampling
    worker = SamplingInfo(temperature=drawn.temperature, top_p=drawn.top_p)
    assert sampling_mismatch(TrainerSettings().sampling, worker) is None


@pytest.mark.parametrize("settings", SERVICES)
def test_nested_and_flat_names(settings, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.settings")
    monkeypatch.setenv("SPARSECAST_SAMPLING__TEMPERATURE", "0.7")
    assert settings().sampling == SamplingSettings(temperature=0.7) and not caplog.records
    monkeypatch.delenv("SPARSECAST_SAMPLING__TEMPERATURE")
    monkeypatch.setenv("SPARSECAST_TEMPERATURE", "0.5")
    monkeypatch.setenv("SPARSECAST_TOP_P", "0.9")
    assert settings().sampling == SamplingSettings(temperature=0.5, top_p=0.9)
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"SPARSECAST_{flat} is deprecated: set SPARSECAST_SAMPLING__{flat} instead "
        "(the flat name will be removed)"
        for flat in ("TEMPERATURE", "TOP_P")
    ]
    monkeypatch.setenv("SPARSECAST_SAMPLING__TEMPERATURE", "0.25")  # the nested name wins
    assert settings().sampling == SamplingSettings(temperature=0.25, top_p=0.9)


def test_flat_keywords_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match=r"temperature: the sampling settings are one section now, "
                                              r"sampling=SamplingSettings\(temperature=...\)"):
        RolloutSettings(temperature=0.5)  # type: ignore[call-arg]
    # Flat keywords of two sections: the message names one section and only its fields.
    only_optim = r"lr: the optim settings are one section now, optim=OptimSettings\(lr=...\)"
    with pytest.raises(ValidationError, match=only_optim):
        TrainerSettings(lr=1e-3, top_p=0.9)  # type: ignore[call-arg]
    monkeypatch.setenv("SPARSECAST_SAMPLING__TOP_P", "0")
    with pytest.raises(ValidationError, match="sampling.top_p"):
        TrainerSettings()
    monkeypatch.delenv("SPARSECAST_SAMPLING__TOP_P")
    monkeypatch.setenv("SPARSECAST_SAMPLING__TOP_K", "5")  # not a field: top-k is always 0 here
    with pytest.raises(ValidationError, match="sampling.top_k"):
        RolloutSettings()


@pytest.mark.parametrize("settings", SERVICES)
def test_help_lists_the_section(settings) -> None:  # type: ignore[no-untyped-def]
    rows = {variable: default for variable, _, default, _ in settings_rows(settings)}
    assert {k: v for k, v in rows.items() if k.startswith("SPARSECAST_SAMPLING")} == {
        "SPARSECAST_SAMPLING__TEMPERATURE": "1.0", "SPARSECAST_SAMPLING__TOP_P": "1.0"}
    assert "SPARSECAST_TEMPERATURE" not in rows
