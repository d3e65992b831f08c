"""Yuanrong backends: without their packages, creating one names the package to install.

Neither ``openyuanrong-datasystem`` nor ``openyuanrong-transfer-engine`` is
installed in the test environment (the transfer engine's data path needs
Ascend CANN; the datasystem needs a running worker cluster), so what can run
here is the unavailable path, the factory wiring and the self-test report.
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_omni_kv.backends.factory import OmniConnectorFactory
from vllm_omni_kv.backends.spec import ConnectorSpec
from vllm_omni_kv.errors import BackendUnavailable

_HAS_YR = importlib.util.find_spec("yr") is not None
absent = pytest.mark.skipif(_HAS_YR, reason="the yr package is installed here")


@absent
def test_datasystem_connector_names_its_package() -> None:
    from vllm_omni_kv.backends.yuanrong.datasystem import YuanrongConnector

    with pytest.raises(BackendUnavailable, match="pip install openyuanrong-datasystem"):
        YuanrongConnector({"host": "127.0.0.1", "port": 31501})


@absent
def test_transfer_engine_connector_names_its_package() -> None:
    from vllm_omni_kv.backends.pull.yuanrong import YuanrongTransferEngineConnector

    with pytest.raises(BackendUnavailable, match="pip install openyuanrong-transfer-engine"):
        YuanrongTransferEngineConnector({"role": "sender"})


@absent
@pytest.mark.parametrize(
    ("alias", "package"),
    [("yuanrong", "openyuanrong-datasystem"), ("yuanrong_te", "openyuanrong-transfer-engine")],
)
def test_factory_creates_lazily_and_reports(alias: str, package: str) -> None:
    with pytest.raises(BackendUnavailable, match=package):
        OmniConnectorFactory.create_connector(ConnectorSpec(name=alias, extra={}))


@absent
def test_selftest_reports_missing_packages() -> None:
    from vllm_omni_kv.backends.yuanrong.datasystem import selftest

    res = selftest()
    assert res["ok"] is False
    assert "openyuanrong-datasystem" in res["detail"]
    assert "openyuanrong-transfer-engine" in res["detail"]


def test_unavailable_is_an_import_error() -> None:
    """Callers that guard optional backends with ``except ImportError`` keep working."""
    assert issubclass(BackendUnavailable, ImportError)
