"""Real-peer helpers for kvpick's KV-event interop tests: the engines' msgspec event structs
(`wire`), a ZeroMQ PUB + ROUTER-replay publisher (`publisher`) and the recorded-fixture
generator (`make_fixtures`)."""
