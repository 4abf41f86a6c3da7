"""Online replay of Mooncake traces through Envoy to `kvpick sim` (see online.py)."""
