"""On-demand captioning over HTTP (``pairforge serve``): a Ray Serve application."""
