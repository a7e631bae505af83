"""The pieces of ``benches/llamacpp_peer.py`` (issue 22): building llama-server, the shared checkpoint and its GGUFs, the two servers, the side-by-side runs."""
