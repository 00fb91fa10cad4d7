"""Configuration: service settings (``settings.py``) and the Celery settings built from them."""
from config.settings import Settings, get_settings

__all__ = ["Settings", "get_settings"]
