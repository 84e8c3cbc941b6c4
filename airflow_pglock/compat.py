"""The one place that knows where Airflow keeps things (Task SDK on 3.x, core on 2.x)."""

from __future__ import annotations

from importlib.metadata import version as _version

AIRFLOW_VERSION: tuple[int, int] = tuple(int(part) for part in _version("apache-airflow").split(".")[:2])  # type: ignore[assignment]
AIRFLOW_V_3_PLUS = AIRFLOW_VERSION >= (3, 0)

if AIRFLOW_V_3_PLUS:
    from airflow.sdk import BaseHook, BaseOperator, BaseSensorOperator, Context, get_current_context
    from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
    from airflow.sdk.configuration import conf
    from airflow.sdk.definitions.mappedoperator import MappedOperator
    from airflow.sdk.exceptions import (
        AirflowFailException,
        AirflowSensorTimeout,
        AirflowSkipException,
        TaskDeferred,
    )
    from airflow.triggers.base import BaseTrigger, TriggerEvent  # triggers stay in core: the triggerer runs them
else:  # Airflow 2.x
    from airflow.configuration import conf  # type: ignore[no-redef]
    from airflow.decorators.base import (  # type: ignore[no-redef]
        DecoratedOperator,
        TaskDecorator,
        task_decorator_factory,
    )
    from airflow.exceptions import (  # type: ignore[no-redef]
        AirflowFailException,
        AirflowSensorTimeout,
        AirflowSkipException,
        TaskDeferred,
    )
    from airflow.hooks.base import BaseHook  # type: ignore[no-redef]
    from airflow.models.baseoperator import BaseOperator  # type: ignore[no-redef]
    from airflow.models.mappedoperator import MappedOperator  # type: ignore[no-redef]
    from airflow.operators.python import get_current_context  # type: ignore[no-redef]
    from airflow.sensors.base import BaseSensorOperator  # type: ignore[no-redef]
    from airflow.triggers.base import BaseTrigger, TriggerEvent  # type: ignore[no-redef]
    from airflow.utils.context import Context  # type: ignore[no-redef]

try:
    from airflow.providers.standard.operators.python import PythonOperator
except ImportError:  # Airflow 2.x without the standard provider
    from airflow.operators.python import PythonOperator  # type: ignore[no-redef]

__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_PLUS",
    "AirflowFailException",
    "AirflowSensorTimeout",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseSensorOperator",
    "BaseTrigger",
    "Context",
    "DecoratedOperator",
    "MappedOperator",
    "PythonOperator",
    "TaskDecorator",
    "TaskDeferred",
    "TriggerEvent",
    "conf",
    "get_current_context",
    "task_decorator_factory",
]
