"""Imported by Python at the start of every process the tests start (tests/conftest.py puts this folder on
``PYTHONPATH``): a new MLflow sqlite store in it is a copy of the session's template (``store_template``)."""

import store_template

store_template.install_hook()
