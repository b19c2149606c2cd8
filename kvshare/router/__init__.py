"""The router (`kvshare route`): an OpenAI-compatible reverse proxy that places requests on replicas by a policy."""
