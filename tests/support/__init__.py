"""Helpers the tests share: servers, proxies, child processes, the Celery app and settings."""
