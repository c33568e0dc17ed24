"""Publishing a head directory to the Hugging Face Hub: the upload folder, its model card, the upload.

Not training: the trainer calls `publish` at the end of a run, `scripts/publish.py` does it any time.
"""

from spechead.heads.hub.publish import Upload, preflight, prepare_upload, publish, upload_to_hub

__all__ = ["Upload", "preflight", "prepare_upload", "publish", "upload_to_hub"]
