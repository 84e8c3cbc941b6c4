"""The one place that knows where Airflow keeps things (Task SDK on 3.x, core on 2.x)."""

from __future__ import annotations

from importlib.metadata import version as _version

AIRFLOW_VERSION: tuple[int, int] = tuple(int(part) for part in _version("apache-airflow").split(".")[:2])  # type: ignore[assignment]
AIRFLOW_V_3_PLUS = AIRFLOW_VERSION >= (3, 0)

if AIRFLOW_V_3_PLUS:
    from airflow.sdk import BaseHook, BaseOperator, BaseSensorOperator, Context
    from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
else:  # Airflow 2.x
    from airflow.decorators.base import (  # type: ignore[no-redef]
        DecoratedOperator,
        TaskDecorator,
        task_decorator_factory,
    )
    from airflow.exceptions import AirflowFailException, AirflowSkipException  # type: ignore[no-redef]
    from airflow.hooks.base import BaseHook  # type: ignore[no-redef]
    from airflow.models.baseoperator import BaseOperator  # type: ignore[no-redef]
    from airflow.sensors.base import BaseSensorOperator  # type: ignore[no-redef]
    from airflow.utils.context import Context  # type: ignore[no-redef]

try:
    from airflow.providers.standard.operators.python import PythonOperator
except ImportError:  # Airflow 2.x without the standard provider
    from airflow.operators.python import PythonOperator  # type: ignore[no-redef]

__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_PLUS",
    "AirflowFailException",
    "AirflowSkipException",
    "BaseHook",
    "BaseOperator",
    "BaseSensorOperator",
    "Context",
    "DecoratedOperator",
    "PythonOperator",
    "TaskDecorator",
    "task_decorator_factory",
]
