"""Every setting a process reads is in the README's settings table, so operators can find it."""
from pathlib import Path

import pytest

from shared import settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("cls", [settings.GatewaySettings, settings.WorkerSettings,
                                 settings.ServicesSettings])
def test_every_setting_has_a_readme_row(cls):
    missing = [f"KVGATE_{name.upper()}" for name in cls.model_fields
               if f"| `KVGATE_{name.upper()}` |" not in README]
    assert not missing, f"settings without a row in README.md's table: {missing}"
