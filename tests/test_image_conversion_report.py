"""``crossfeed convert images --convert png|jpeg`` says, per kind of file, what re-encoding loses."""

from __future__ import annotations

import numpy as np
from PIL import Image

from crossfeed.beam_jobs.images import ImageFolderSource


def test_convert_report_names_what_each_kind_of_file_loses(tmp_path):
    root = tmp_path / "img"
    (root / "a").mkdir(parents=True)
    Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000).save(root / "a" / "deep.png")  # 16-bit
    Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8)).save(root / "a" / "deep2.png")
    Image.new("RGBA", (8, 8), (255, 0, 0, 0)).save(root / "a" / "alpha.png")
    Image.new("CMYK", (8, 8), (0, 255, 0, 0)).save(root / "a" / "cmyk.jpg", format="JPEG")
    Image.new("RGB", (8, 8)).save(root / "a" / "plain.png")  # stored as-is: not in the report
    png = ImageFolderSource.scan(root, convert="png").report()
    assert len(png) == 3 and png[0].startswith("--convert png: 2 PNG I;16 files (e.g. a/deep.png)")
    assert "16-bit gray scaled to 8-bit" in png[0]
    assert any("RGBA" in line and "alpha composited on white and dropped" in line for line in png)
    assert any("CMYK" in line and "converted to RGB without color management" in line for line in png)
    assert not any("plain.png" in line for line in png)
    jpeg = ImageFolderSource.scan(root, convert="jpeg").report()
    assert all("JPEG quality 95 (lossy)" in line for line in jpeg)
    assert ImageFolderSource.scan(root).report() == []  # nothing is re-encoded without --convert
