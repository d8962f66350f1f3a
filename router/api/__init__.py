"""The HTTP side of the gateway: the ASGI app, OpenAI and admin routes, request and response shapes."""
