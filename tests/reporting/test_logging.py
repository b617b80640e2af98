"""get_logger's records point at the line that logged, as Accelerate's do."""

from __future__ import annotations

import inspect
import logging

from notebook_accel import get_logger


def test_a_record_names_the_callers_file_line_and_function(caplog):
    logger = get_logger(__name__)
    line = inspect.currentframe().f_lineno + 1
    logger.warning("here")
    (record,) = caplog.records
    assert (record.filename, record.lineno, record.funcName) == (
        "test_logging.py",
        line,
        "test_a_record_names_the_callers_file_line_and_function",
    )
    assert record.getMessage() == "here"


def test_a_callers_own_stacklevel_wins(caplog):
    logger = get_logger(__name__)

    def helper():
        logger.warning("from the helper's caller", stacklevel=3)

    line = inspect.currentframe().f_lineno + 1
    helper()
    (record,) = caplog.records
    assert (record.lineno, record.funcName) == (line, "test_a_callers_own_stacklevel_wins")


def test_every_process_variant_also_names_the_caller(caplog):
    caplog.set_level(logging.INFO)
    logger = get_logger(__name__)
    line = inspect.currentframe().f_lineno + 1
    logger.info("all", main_process_only=False, in_order=True)
    assert caplog.records[0].lineno == line
