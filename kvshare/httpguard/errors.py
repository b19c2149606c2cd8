"""What kvshare's HTTP servers tell each other about an error: a replica marks a 5xx that the request caused alone
(another replica would fail it the same way), and the router never retries such a request elsewhere."""

ERROR_CAUSE_HEADER = "x-kvshare-error-cause"
REQUEST_CAUSED = "request"
