"""The trainer's optimizer settings are one section, `optim` (services.trainer.optim.OptimSettings):
set by SPARSECAST_OPTIM__* (the flat SPARSECAST_LR, ... are deprecated aliases), listed by --help;
the learner takes its sections and a few values (LearnerConfig), not the whole TrainerSettings."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
from pydantic import ValidationError

from services.demo.options import DemoOptions
from services.trainer.distributed import DistributedLearner, make_learner
from services.trainer.learner import Learner, LearnerConfig
from services.trainer.loss import LossConfig
from services.trainer.optim import DEMO_OPTIM, OptimSettings
from services.trainer.settings import FLAT_OPTIM_NAMES, PublishSettings, TrainerSettings
from shared.sampling import SamplingSettings
from shared.settings_help import settings_help, settings_rows

pytestmark = pytest.mark.usefixtures("clean_settings_env")


def test_nested_and_flat_names_set_the_learning_rate(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="shared.settings")
    monkeypatch.setenv("SPARSECAST_OPTIM__LR", "3e-4")
    assert TrainerSettings().optim.lr == 3e-4
    assert not caplog.records  # the nested name is not deprecated
    monkeypatch.delenv("SPARSECAST_OPTIM__LR")
    monkeypatch.setenv("SPARSECAST_LR", "3e-4")
    assert TrainerSettings().optim.lr == 3e-4
    assert [r.getMessage() for r in caplog.records] == [
        "SPARSECAST_LR is deprecated: set SPARSECAST_OPTIM__LR instead (the flat name will be removed)"
    ]
    assert TrainerSettings().optim.lr == 3e-4 and len(caplog.records) == 1  # warned once


def test_every_flat_name_is_an_alias_and_the_nested_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = {"SPARSECAST_LR": "2e-5", "SPARSECAST_WEIGHT_DECAY": "0", "SPARSECAST_BETA1": "0.8",
            "SPARSECAST_BETA2": "0.95", "SPARSECAST_GRAD_CLIP": "0.5"}
    assert {f"SPARSECAST_{name}".upper() for name in FLAT_OPTIM_NAMES} == set(flat)
    for name, value in flat.items():
        monkeypatch.setenv(name, value)
    assert TrainerSettings().optim == OptimSettings(lr=2e-5, weight_decay=0.0, beta1=0.8, beta2=0.95,
                                                    grad_clip=0.5)
    monkeypatch.setenv("SPARSECAST_OPTIM__LR", "7e-6")
    optim = TrainerSettings().optim
    assert (optim.lr, optim.beta2) == (7e-6, 0.95)
    # A given section wins over the environment, as any argument does.
    assert TrainerSettings(optim=OptimSettings(lr=1e-3)).optim == OptimSettings(lr=1e-3)


def test_flat_keywords_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match=r"lr: the optim settings are one section now"):
        TrainerSettings(lr=1e-3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"beta1, grad_clip: .*\(beta1=..., grad_clip=...\)"):
        TrainerSettings(grad_clip=2.0, beta1=0.5)  # type: ignore[call-arg]
    monkeypatch.setenv("SPARSECAST_OPTIM__LR", "0")
    with pytest.raises(ValidationError, match="optim.lr"):
        TrainerSettings()
    monkeypatch.delenv("SPARSECAST_OPTIM__LR")
    monkeypatch.setenv("SPARSECAST_OPTIM__MOMENTUM", "0.9")  # not a field of the section
    with pytest.raises(ValidationError, match="optim.momentum"):
        TrainerSettings()


def test_one_default_for_the_learning_rate() -> None:
    assert OptimSettings() == OptimSettings(lr=1e-6, weight_decay=0.1, beta1=0.9, beta2=0.98, grad_clip=1.0)
    assert TrainerSettings().optim == OptimSettings()
    assert not {"lr", "weight_decay", "beta1", "beta2", "grad_clip"} & set(TrainerSettings.model_fields)
    # The demo's is a named value of the same section, and the demo's option is it.
    assert DEMO_OPTIM == OptimSettings(lr=5e-5) and DemoOptions().lr == DEMO_OPTIM.lr


def test_help_lists_the_optim_section() -> None:
    rows = {variable: default for variable, _, default, _ in settings_rows(TrainerSettings)}
    section = {name: default for name, default in rows.items() if name.startswith("SPARSECAST_OPTIM")}
    assert section == {"SPARSECAST_OPTIM__LR": "1e-06", "SPARSECAST_OPTIM__WEIGHT_DECAY": "0.1",
                       "SPARSECAST_OPTIM__BETA1": "0.9", "SPARSECAST_OPTIM__BETA2": "0.98",
                       "SPARSECAST_OPTIM__GRAD_CLIP": "1.0"}
    assert "SPARSECAST_LR" not in rows
    text = settings_help("python -m services.trainer", "The trainer.", TrainerSettings)
    assert "SPARSECAST_OPTIM__LR" in text and "AdamW learning rate" in text


def test_the_learner_takes_its_sections_not_the_settings() -> None:
    for init in (Learner.__init__, DistributedLearner.__init__, make_learner):
        parameters = list(inspect.signature(init).parameters.values())
        config = parameters[1] if parameters[0].name == "self" else parameters[0]
        assert (config.name, config.annotation) == ("config", "LearnerConfig")
    settings = TrainerSettings(optim=OptimSettings(lr=3e-4, grad_clip=0.5), loss=LossConfig(kl_coef=0.1),
                               micro_batch=8, ppo_updates=2, sampling=SamplingSettings(temperature=0.7),
                               seed=5, publish=PublishSettings(encoding="auto"))
    config = LearnerConfig.of(settings)
    assert config.optim is settings.optim and config.loss is settings.loss
    # Everything else it reads is a trainer setting of the same name, copied as is.
    assert config.temperature == settings.sampling.temperature == 0.7  # its one field of `sampling`
    assert config.patch_encoding == settings.publish.encoding == "auto"
    # Derived: an adaptive KV budget under eviction replay (test_eviction_replay covers it on).
    assert config.dense_mismatch is False
    sections = ("optim", "loss", "temperature", "patch_encoding", "dense_mismatch")
    others = [f.name for f in dataclasses.fields(LearnerConfig) if f.name not in sections]
    assert [getattr(config, name) for name in others] == [getattr(settings, name) for name in others]


def test_the_publish_section_and_its_flat_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainerSettings().publish == PublishSettings(encoding="zstd", snapshot_every=0)
    assert not {"patch_encoding", "upload_snapshot_every"} & set(TrainerSettings.model_fields)
    monkeypatch.setenv("SPARSECAST_PUBLISH__ENCODING", "auto")
    monkeypatch.setenv("SPARSECAST_UPLOAD_SNAPSHOT_EVERY", "5")  # deprecated, still read
    monkeypatch.setenv("SPARSECAST_PATCH_ENCODING", "values")  # the nested name wins
    assert TrainerSettings().publish == PublishSettings(encoding="auto", snapshot_every=5)
    with pytest.raises(ValidationError, match=r"patch_encoding: the publish settings are one section now"):
        TrainerSettings(patch_encoding="auto")  # type: ignore[call-arg]
    monkeypatch.setenv("SPARSECAST_PUBLISH__ENCODING", "gzip")
    with pytest.raises(ValidationError, match="publish.encoding"):
        TrainerSettings()
