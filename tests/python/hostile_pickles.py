"""Writes torch.save-shaped zip files whose data.pkl is hostile, for the
weights-only loader's tests. usage: hostile_pickles.py OUT_DIR"""
import io
import os
import sys
import zipfile

import torch

out = sys.argv[1]
buffer = io.BytesIO()
torch.save({"w": torch.ones(2)}, buffer)
template = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))


def write(name, pickle_bytes):
    with zipfile.ZipFile(os.path.join(out, name), "w", compression=zipfile.ZIP_STORED) as z:
        for info in template.infolist():
            data = template.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = pickle_bytes
            z.writestr(info.filename.replace("archive/", name.split(".")[0] + "/"), data)


# A list that contains itself.
write("cycle.pt", b"\x80\x02]q\x00h\x00a.")
# A million nested one-tuples.
write("deep.pt", b"\x80\x02N" + b"\x85" * 1_000_000 + b".")
# Sizes and strides of different lengths.
rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n"
storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"
write("strides.pt", b"\x80\x02" + rebuild + b"(" + storage + b"K\x00K\x04K\x04K\x04\x87K\x01\x85\x89Ntq\x00R.")
# A view far past the end of its 2-element storage.
write("overflow.pt", b"\x80\x02" + rebuild + b"(" + storage + b"K\x00K\x04\x85J\xff\xff\xff\x7f\x85\x89NtR.")
