"""Version-neutral Airflow names for test code: ``from tests.sdk import DAG, task, BashOperator``.

Airflow 3's ``airflow.sdk`` names (and a few others that moved) on Airflow 3; their
Airflow 2 homes on 2.11. For test code that builds DAGs in-process; DAG *sources* written
to files get the same mapping from ``tests.helpers.write_dag``.
"""

from __future__ import annotations

import importlib
from typing import Any

from airflow_pglock.compat import AIRFLOW_V_3_PLUS
from tests.helpers import AIRFLOW_2_HOMES

#: name -> (Airflow 3 module, Airflow 2 module, Airflow 2 name) for names outside airflow.sdk.
ELSEWHERE: dict[str, tuple[str, str, str]] = {
    "BashOperator": ("airflow.providers.standard.operators.bash", "airflow.operators.bash", "BashOperator"),
    "DagBag": ("airflow.dag_processing.dagbag", "airflow.models.dagbag", "DagBag"),
    "serialize": ("airflow.sdk.serde", "airflow.serialization.serde", "serialize"),
    "deserialize": ("airflow.sdk.serde", "airflow.serialization.serde", "deserialize"),
    "DagSerialization": (
        "airflow.serialization.serialized_objects",
        "airflow.serialization.serialized_objects",
        "SerializedDAG",
    ),
}


def __getattr__(name: str) -> Any:
    if name in ELSEWHERE:
        three, two, two_name = ELSEWHERE[name]
        if AIRFLOW_V_3_PLUS:
            try:
                return getattr(importlib.import_module(three), name)
            except (ModuleNotFoundError, AttributeError):  # Airflow 3.0, 3.1: still in the 2.x home
                pass
        return getattr(importlib.import_module(two), two_name)
    if AIRFLOW_V_3_PLUS:
        return getattr(importlib.import_module("airflow.sdk"), name)
    homes = AIRFLOW_2_HOMES["airflow.sdk"]
    assert isinstance(homes, dict)
    if name not in homes:
        raise AttributeError(f"tests.sdk has no Airflow 2 home for {name!r}: add it to tests.helpers.AIRFLOW_2_HOMES")
    return getattr(importlib.import_module(homes[name]), name)
