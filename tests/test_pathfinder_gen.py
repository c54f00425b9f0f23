"""Pathfinder generator (lra/data/pathfinder_gen.py): labels, markers, contour connectivity, seeding,
parallel determinism and the lra_release layout. CPU only, 32 px.

Connectivity at 32 px cannot be decided on raw pixels alone: paddles are dashes with ~2 px gaps, and the
keep-out masks (margin 1 px, blurred by LANCZOS, accepted while mask sums stay < 1.8) let different snakes
pass within 1 px of each other or touch. Measured on 300 hard images (distractors included): without gap
closing ~80 % of positives are broken at the gaps and ~25 % of negatives are joined through a touching snake;
closing the gaps (1 px) joins ~95 % of negatives. So the checks below flood-fill each target snake's own
rendering (``_render(..., debug=True)``), and check on the final image that those strokes and the markers are
really drawn there. The one failure mode left is a label-0 image whose second marker lies on the other target's
ink (the snakes cross there): ~3 % measured, asserted below 8 %.

Dtypes (module docstring): snakes2 pastes each float64 paddle patch into a float32 'F' canvas, so line and mask
values are float32-rounded; the tests write that arithmetic out, derive which grey levels it allows at 32 px,
and check a few hundred images against the derivation.
"""
import dataclasses
import filecmp
import hashlib
import json
import math

import numpy as np
import pandas as pd
import pytest
from PIL import Image, ImageDraw
from scipy import ndimage

from lra.data import pathfinder_gen as pg
from lra.data import pathfinder_jit

N_SAMPLES = 160
# sha256 of the 160 images and labels of ``samples`` as GENERATOR_VERSION draws them; the rows of every Pathfinder
# run name that version, and the leaderboard never averages two versions, so images must not change under it
FINGERPRINT = {2: "0946d662253a1890572c3b3c232f62c066f294452bb4d9e7e4f4e76e20fe6181"}
EIGHT = np.ones((3, 3), bool)
CROSS = ndimage.generate_binary_structure(2, 1)


@pytest.fixture(scope="module")
def samples():
    params = pg.PathfinderParams.for_lra(32, "hard")
    rng = pg.batch_rng(1234, 0)
    return [pg._render(params, rng, debug=True) for _ in range(N_SAMPLES)]


def test_lra_parameters():
    p = pg.PathfinderParams.for_lra(32, "hard")
    assert p == pg.PathfinderParams()  # the defaults are LRA's Pathfinder set
    assert (p.contour_length, p.distractor_length, p.num_distractor_snakes) == (14, 4, 5)
    expected = {32: (10, 6, 5), 64: (11, 7, 5), 128: (17, 11, 8), 256: (15, 10, 7)}  # LRA's per-resolution parameters
    for res, counts in expected.items():
        got = tuple(pg.PathfinderParams.for_lra(res, d).num_distractor_snakes for d in pg.DIFFICULTIES)
        assert got == counts, res
    px = pg.PathfinderParams.for_lra(128, "hard")
    assert (px.paddle_margin_list, px.seed_distance, px.paddle_length, px.continuity) == ((2, 3), 20, 5, 1.8)
    with pytest.raises(ValueError):
        pg.PathfinderParams.for_lra(48, "hard")


def test_cv2_border_quirk_restricts_seed_angles():
    # cv2.dilate's -DBL_MAX border leaves 30 of 360 seed angles usable at 32 px (module docstring)
    p = pg.PathfinderParams()
    usable = [pg._seed_info(p, 1, a * math.pi / 180)[1] for a in range(-180, 180)]
    assert sum(usable) == 30
    loose = dataclasses.replace(p, cv2_border=False)
    assert all(pg._seed_info(loose, 1, a * math.pi / 180)[1] for a in range(-180, 180, 10))


def _snakes2_paste(hw, start, theta, contrast, p, margin):
    """snakes.draw_line_n_mask written out: float64 patches (k / 255, times the contrast) assigned into
    ``np.array(Image.new('F', ...))`` canvases; the uint8 steps (bytescale, LANCZOS, dilation) are the port's."""
    length, thick, aa = p.paddle_length, p.paddle_thickness, p.antialias_scale
    r = length + math.ceil(thick) + margin
    blown = Image.new("F", (2 * r * aa + 1,) * 2, "black")
    head = pg._step((r * aa, r * aa), theta, length * aa)
    ImageDraw.Draw(blown).line([(r * aa, r * aa), (head[1], head[0])], fill="white", width=round(thick * aa))
    blown = np.array(blown)
    miniline = pg._shrink(blown, (2 * r + 1,) * 2).astype(np.float64) / 255
    if contrast != 1.0:
        miniline *= contrast
    minimask = pg._shrink(pg._dilate(blown, pg._disk(margin * aa)).astype(np.uint8), (2 * r + 1,) * 2) / 255
    l_im = np.array(Image.new("F", (hw[1], hw[0]), "black"))
    m_im = l_im.copy()
    y0, x0 = start[0] - r, start[1] - r
    cy, cx = slice(max(y0, 0), min(y0 + 2 * r + 1, hw[0])), slice(max(x0, 0), min(x0 + 2 * r + 1, hw[1]))
    py, px = slice(cy.start - y0, cy.stop - y0), slice(cx.start - x0, cx.stop - x0)
    l_im[cy, cx], m_im[cy, cx] = miniline[py, px], minimask[py, px]
    return l_im, m_im


def test_patches_are_pasted_and_composed_as_in_snakes2():
    p = pg.PathfinderParams()
    hw, m = p.window_size, 1
    key = (p.paddle_length, p.paddle_thickness, m, p.antialias_scale)
    scene, rounded = pg._Scene(p, None, m), 0
    for deg, start, contrast in [(-135, (16, 16), 1.5), (37, (0, 5), 2.0), (100, (31, 30), 1.5),
                                 (-100, (14, 17), 1.5), (-128, (15, 14), 2.0), (12, (17, 16), 1.5)]:
        theta = deg * math.pi / 180
        l_im, m_im = _snakes2_paste(hw, start, theta, contrast, p, m)
        pad = scene.paddle(start, theta, contrast)
        assert pad.line.dtype == pad.mask.dtype == np.float32
        assert np.array_equal(pad.line, l_im[pad.win]) and np.array_equal(pad.mask, m_im[pad.win])
        product = pg._paddle_patch(theta, *key)[0] * contrast  # float64, before the paste
        rounded += not np.array_equal(pg._contrast_line(theta, *key, contrast), product)
        image, mask = scene.img.copy(), scene.mask.copy()  # float64 accumulators, as snakes2's np.zeros
        accept = np.max(mask + m_im) < 1.8  # extend_snake's test: float64 + float32 -> float64
        assert (np.max(scene.mask[pad.win] + pad.mask) < 1.8) == accept  # the port's form of it
        scene.draw(pad)
        scene.keep_out(pad)
        assert scene.img.dtype == scene.mask.dtype == np.float64
        assert np.array_equal(scene.img, np.maximum(image, l_im))
        assert np.array_equal(scene.mask, np.maximum(mask, m_im))
    assert rounded  # the float32 paste is not a no-op
    # 459/255 is 1.8 exactly: an existing 210/255 under a new paddle's 249/255 sums to just below 1.8 in float64
    # (accepted by version 1) and to just above from snakes2's float32-rounded values (rejected)
    assert 210 / 255 + 249 / 255 < 1.8 <= np.float64(np.float32(210 / 255)) + np.float32(249 / 255)
    theta = next(t for t in np.arange(-180, 180) * math.pi / 180
                 if (np.rint(pg._paddle_patch(t, *key)[1] * 255) == 249).any())
    scene = pg._Scene(p, None, m)
    l_im, m_im = _snakes2_paste(hw, (16, 16), theta, 2.0, p, m)
    scene.mask[:] = np.where(np.rint(m_im * 255) == 249, np.float32(210 / 255), 0)  # as a keep_out leaves it
    pad = scene.paddle((16, 16), theta, 2.0)
    assert np.max(scene.mask + m_im) >= 1.8 and np.max(scene.mask[pad.win] + pad.mask) >= 1.8


def _grey_levels(rounding: bool) -> set:
    """Every grey level a 32 px image can show, derived from the sources of a pixel's value. A level is
    bytescale(v) = floor(v * 255 / top + 0.5), background 0, with v the pixel's brightest source: a target
    paddle (k / 255) * 1.5, a distractor paddle (k / 255) * 2.0 (k: a uint8 of a LANCZOS-shrunk patch;
    rounded to float32 by snakes2's paste) or a marker k / 255 (float64 everywhere), and top the image's
    brightest value: a marker's 1.0 or a distractor's above it. Targets may carry any patch (the second
    target's seed angle is never checked); distractors only patches of seed angles that cv2's border leaves
    usable and of growth steps; markers sit on tips >= 2 px from the border (the padding's keep-out, dilated
    by the margin, leaves no growth weight within 1 px of it)."""
    p = pg.PathfinderParams()
    m = p.paddle_margin_list[0]

    def ks(theta):
        line = pg._paddle_patch(theta, p.paddle_length, p.paddle_thickness, m, p.antialias_scale)[0]
        return set(np.rint(line * 255).astype(int).ravel().tolist())

    dy, dx = pg._circle(p.paddle_length + m)
    grow = set().union(*(ks(pg._flip(math.atan2(a, b))) for a, b in zip(np.floor(dy), np.floor(dx))))
    seeds = {a: ks(a * math.pi / 180) for a in range(-180, 180)}
    usable = [k for a, k in seeds.items() if pg._seed_info(p, m, a * math.pi / 180)[1]]
    scene = pg._Scene(p, None, m)
    markers = set().union(*(set(scene.marker((y, x)).ravel().tolist()) for y in range(2, 30) for x in range(2, 30)))
    paste = (lambda v: float(np.float32(v))) if rounding else float
    sources = ([paste(k / 255 * 1.5) for k in grow.union(*seeds.values())]
               + [paste(k / 255 * 2.0) for k in grow.union(*usable)] + [k / 255 for k in markers])
    tops = [1.0] + [v for v in sources if v > 1.0]
    return {int(pg._bytescale(np.array([0.0, v, top]))[1]) for top in tops for v in sources if v <= top}


def test_grey_levels_derived_from_the_float32_paste(samples):
    snakes2, float64 = _grey_levels(rounding=True), _grey_levels(rounding=False)
    assert snakes2 - float64 == {22} and float64 - snakes2 == {77, 158, 218}
    # a few hundred images: 160 hard (the fixture) and 160 easy
    rng, easy = pg.batch_rng(99, 0), pg.PathfinderParams.for_lra(32, "easy")
    images = samples + [pg._render(easy, rng, debug=True) for _ in range(160)]
    for _, _, _, info in images:  # stroke values are float32 numbers (held in the float64 image)
        assert np.array_equal(info["strokes"], info["strokes"].astype(np.float32))
    counts = np.bincount(np.concatenate([img.ravel() for img, *_ in images]), minlength=256)
    assert set(np.flatnonzero(counts)) <= snakes2
    assert counts[22] > 0 and counts[[77, 158, 218]].sum() == 0, counts[[22, 77, 158, 218]]


def test_the_generator_version_names_the_images_it_draws(samples):
    """A change to the renderer that moves any pixel or label for a seed must bump GENERATOR_VERSION (and add its
    fingerprint here): rows on the old images then stand apart from rows on the new ones. numpy's Generator stream
    and Pillow's LANCZOS are part of the drawing, so another version of either can fail this too, and then the
    same seed does not give the same dataset."""
    digest = hashlib.sha256()
    for img, label, _, _ in samples:
        digest.update(img.tobytes())
        digest.update(bytes([label]))
    assert digest.hexdigest() == FINGERPRINT[pg.GENERATOR_VERSION], \
        f"pathfinder_gen v{pg.GENERATOR_VERSION} draws other images now (numpy {np.__version__}, " \
        f"Pillow {Image.__version__}): bump GENERATOR_VERSION if the renderer changed"


def test_images_and_label_balance(samples):
    labels = np.array([s[1] for s in samples])
    assert set(labels) == {0, 1}
    assert 0.35 < labels.mean() < 0.65, labels.mean()  # 160 fair coins: sd 0.04
    for img, _label, margin, _info in samples:
        assert img.dtype == np.uint8 and img.shape == (32, 32)
        assert img.min() == 0 and img.max() == 255  # bytescaled: background 0, brightest stroke 255
        assert margin == 1


def test_both_markers_present(samples):
    for img, _, _, info in samples:
        strokes, markers = info["strokes"], info["marker_layer"]
        assert np.array_equal(img, pg._bytescale(np.maximum(strokes, markers)))  # what the image is made of
        blobs, n = ndimage.label(markers > 0.5, structure=EIGHT)
        centres = {blobs[m] for m in info["markers"]}
        assert 0 not in centres and len(centres) == n  # every disc sits on a marker centre ...
        assert n == 2 or abs(np.subtract(*info["markers"])).max() <= 3  # ... and they merge only when close
        for m in info["markers"]:
            assert img[m] >= 200  # and shows: 1.0 against strokes that peak at 1.2 (distractors) or less


def _component(layer, at, closing):
    ink = layer > 0.02
    if closing:
        ink = ndimage.binary_dilation(ink, structure=CROSS, iterations=closing)
    lab, _ = ndimage.label(ink, structure=EIGHT)
    return lab, lab[at]


def test_markers_sit_on_the_right_contours(samples):
    negatives = crossings = 0
    for img, label, _, info in samples:
        (m0, m1), o = info["markers"], info["marked"]
        targets = info["targets"]
        assert m0 != m1  # an origin tip and a terminal tip
        for t in targets:  # each target snake is really in the image
            assert (img[t > 0.2] > 0).all()
        if label == 1:
            # one snake carries both markers: flood-fill it, closing its 2-px paddle gaps
            lab, c = _component(targets[o], m0, closing=1)
            assert c != 0 and lab[m1] == c
        else:
            negatives += 1
            assert targets[o][m0] > 0.02 and targets[1 - o][m1] > 0.02  # each marker on its own snake
            lab, c = _component(targets[o], m0, closing=0)
            crossings += lab[m1] == c or targets[o][m1] > 0.02
    assert negatives > 40
    assert crossings / negatives < 0.08, (crossings, negatives)


def test_positive_contours_connect_in_the_rendered_image(samples):
    # on the final image (distractors included), the ink along the marked snake joins a positive's markers
    # once the 2-px paddle gaps are closed; without closing most are not joined (dashed contours)
    joined = joined_raw = positives = 0
    for img, label, _, info in samples:
        if label:
            positives += 1
            m0, m1 = info["markers"]
            along = ndimage.binary_dilation(info["targets"][info["marked"]] > 0.02, structure=EIGHT)
            ink = ndimage.binary_dilation((img > 0) & along, structure=CROSS)
            lab, _ = ndimage.label(ink, structure=EIGHT)
            joined += lab[m0] == lab[m1] != 0
            lab, _ = ndimage.label(img > 10, structure=EIGHT)
            joined_raw += lab[m0] == lab[m1] != 0
    assert joined == positives
    assert joined_raw < 0.5 * positives


def test_seeding_is_reproducible():
    p = pg.PathfinderParams.for_lra(32, "easy")

    def draw(seed, k=0, n=3):
        rng = pg.batch_rng(seed, k)
        return [pg.render_sample(p, rng) for _ in range(n)]

    a, b = draw(5), draw(5)
    assert all(np.array_equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))
    assert not np.array_equal(a[0][0], a[1][0])  # the stream advances within a batch
    for other in (draw(6), draw(5, k=1)):  # another seed, another batch
        assert not any(np.array_equal(x[0], y[0]) for x, y in zip(a, other))


def _lines(folder, k):
    text = (folder / "metadata" / f"{k}.npy").read_text()
    assert text.endswith("\n")
    return [line.split(" ") for line in text.split("\n")[:-1]]  # as LRA reads it


def test_layout_workers_and_resume(tmp_path):
    kw = {"resolution": 32, "difficulty": "easy", "n": 7, "seed": 3, "batch_size": 4, "progress": False}
    one = pg.generate(tmp_path / "w1", workers=1, **kw)
    two = pg.generate(tmp_path / "w2", workers=2, **kw)
    assert one == tmp_path / "w1" / "pathfinder32" / "curv_baseline"
    assert json.loads((one / "pathfinder_gen.json").read_text())["version"] == pg.GENERATOR_VERSION == 2
    for folder in (one, two):
        assert sorted(p.name for p in (folder / "metadata").iterdir()) == ["0.npy", "1.npy"]
    for k, size in ((0, 4), (1, 3)):
        assert _lines(one, k) == _lines(two, k)
        rows = _lines(one, k)
        assert len(rows) == size
        for i, f in enumerate(rows):
            assert len(f) == 11
            assert f[:3] == [f"imgs/{k}", f"sample_{i}.png", str(i)] and f[3] in ("0", "1")
            assert f[4:] == ["1.0", "6", "2", "2", "0.5", "1", "1"]  # a release metadata line, pathfinder32 easy
            png = one / f[0] / f[1]
            with Image.open(png) as im:
                assert im.mode == "L" and im.size == (32, 32)
                assert np.asarray(im).max() == 255
            assert filecmp.cmp(png, two / f[0] / f[1], shallow=False)  # workers do not change a pixel
    # the same images come back from render_sample with the batch's stream
    rng = pg.batch_rng(3, 1)
    img, label = pg.render_sample(pg.PathfinderParams.for_lra(32, "easy"), rng)
    with Image.open(one / "imgs" / "1" / "sample_0.png") as im:
        assert np.array_equal(np.asarray(im), img) and int(_lines(one, 1)[0][3]) == label
    # resume: a finished batch is skipped, a missing one is rebuilt identically
    (one / "metadata" / "1.npy").unlink()
    (one / "imgs" / "1" / "sample_2.png").unlink()
    stamp = (one / "metadata" / "0.npy").stat().st_mtime_ns
    pg.generate(tmp_path / "w1", workers=1, **kw)
    assert (one / "metadata" / "0.npy").stat().st_mtime_ns == stamp
    assert filecmp.cmp(one / "imgs" / "1" / "sample_2.png", two / "imgs" / "1" / "sample_2.png", shallow=False)
    # growing n completes the short last batch; its first images stay the same
    pg.generate(tmp_path / "w1", workers=1, **{**kw, "n": 8})
    assert len(_lines(one, 1)) == 4 and _lines(one, 1)[:3] == _lines(two, 1)
    assert filecmp.cmp(one / "imgs" / "1" / "sample_1.png", two / "imgs" / "1" / "sample_1.png", shallow=False)
    with pytest.raises(ValueError):  # other settings into the same folder would mix two datasets
        pg.generate(tmp_path / "w1", workers=1, **{**kw, "seed": 4})
    manifest = one / "pathfinder_gen.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 1}))
    with pytest.raises(ValueError):  # ... and so would another generator version
        pg.generate(tmp_path / "w1", workers=1, **{**kw, "n": 8})


# sha256 over (image bytes, label, margin) of the first n images of batch 0 of a seed, as pathfinder_gen v2 drew them
# before its target pairs were decided from paddle lists (commit cba04e0): a change of algorithm keeps them all
SAME_AS_V2 = {
    (32, "hard", 0, 200): "cf5d6fcd37b6c19f929d865dfb7bbf471efb3abdffb16b2c4f908e501ac77e12",
    (32, "hard", 7, 100): "c85f9b480a9ba0d871270646375b957f6124b2bc2ce436a4a9e92a38245776b8",
    (32, "easy", 1, 100): "293b01feee9db30677c46419fe76936cf1fcaf436af2acf3f5ea51c5fdd73ba3",
    (32, "intermediate", 2, 100): "00998678595ae2e9b87a1c1f2a52de855c38fa64bdbecf9269164bca3fbccd2d",
    (64, "hard", 3, 20): "b809a69b8463de29546397a6cad792bdcf74283bc1352455207ce8c887e659fc",
    (128, "hard", 0, 40): "9d8453cb0a6d00ec9636542debb2e8ea0af9c502a59bebe000f764a44b77e827",
    (128, "hard", 5, 20): "a6207fabeee23b1f4de7647a0426e000f0bd9e6d12d36b53674f751857dce34a",
    (128, "easy", 4, 10): "cb4bac37eccd476db8db81392344d1467f6ae23a36ea4388960cf98a2a5627ab",
    (256, "hard", 6, 4): "93d56c7980f82d5865975beff0c78a68e60b80c99e8f28827489cd2fea3dfc04",
}
SLOW_CASES = {(64, "hard", 3, 20), (128, "hard", 0, 40)}


def _digest(res, difficulty, seed, n, **kw) -> str:
    params, rng, digest = pg.PathfinderParams.for_lra(res, difficulty), pg.batch_rng(seed, 0), hashlib.sha256()
    for _ in range(n):
        img, label, margin, _ = pg._render(params, rng, **kw)
        digest.update(img.tobytes())
        digest.update(bytes([label, margin]))
    return digest.hexdigest()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in SAME_AS_V2], ids=lambda c: "-".join(map(str, c)))
def test_images_are_those_of_version_2(case):
    assert pg.GENERATOR_VERSION == 2
    assert _digest(*case) == SAME_AS_V2[case]


def test_the_canvas_code_draws_the_same_images_layers_and_stream():
    """``_render(reference=True)`` runs the canvas code (targets / extend / many_snakes on H x W masks) that drew
    version 2 before paddle lists: the same images, labels, margins, markers, debug layers and random stream."""
    for res, difficulty, seed, n in ((32, "hard", 11, 30), (32, "easy", 12, 10), (128, "hard", 13, 1)):
        params, a, b = pg.PathfinderParams.for_lra(res, difficulty), pg.batch_rng(seed, 0), pg.batch_rng(seed, 0)
        for _ in range(n):
            old, new = pg._render(params, a, debug=True, reference=True), pg._render(params, b, debug=True)
            assert np.array_equal(old[0], new[0]) and old[1:3] == new[1:3]
            assert old[3]["markers"] == new[3]["markers"] and old[3]["marked"] == new[3]["marked"]
            for key in ("strokes", "marker_layer"):
                assert np.array_equal(old[3][key], new[3][key])
            assert all(np.array_equal(s, t) for s, t in zip(old[3]["targets"], new[3]["targets"]))
            assert a.bit_generator.state == b.bit_generator.state


def test_every_shortcut_falls_back_on_the_exact_arithmetic(monkeypatch):
    """A tie margin of 2 sends every growth step to the exact pmf on the mask (``_exact_cmf``), and without the
    direct C calls every draw goes through the Generator's methods: the v2 images either way."""
    case, exact, steps = (32, "hard", 7, 100), pg._Scene._exact_cmf, []

    def counted(*args):
        steps.append(1)
        return exact(*args)

    monkeypatch.setattr(pg, "_TIE", 2.0)
    monkeypatch.setattr(pg._Scene, "_exact_cmf", counted)
    assert _digest(*case) == SAME_AS_V2[case]
    assert len(steps) > 10_000
    monkeypatch.undo()
    monkeypatch.setattr(pg, "_draws_match", lambda draws, kind: False)
    assert _digest(*case) == SAME_AS_V2[case]


def test_direct_draws_are_the_generators():
    ours, theirs = np.random.default_rng(3), np.random.default_rng(3)
    integers, random, bounded, *_ = pg._direct(ours)
    angle, small = bounded(-180, 180), bounded(0, 7)
    for i in range(6000):
        low, high = [(0, 1), (0, 2), (-180, 180), (0, 360), (0, 3), (0, 99991)][i % 6]
        assert integers(low, high) == int(theirs.integers(low, high))
        assert angle() == int(theirs.integers(-180, 180)) and small() == int(theirs.integers(0, 7))
        assert random() == theirs.random()
    assert ours.bit_generator.state == theirs.bit_generator.state
    assert pg._draws_match(pg._direct, np.random.PCG64)  # else generation is right, only slower


def test_word_draws_are_the_generators():
    """Draws made in Python from blocks of raw outputs (what the paddle-list code draws with): value for value the
    Generator's, and settle() leaves the generator where the Generator's own draws leave it, across block ends, with
    a 32-bit half kept or not, and with Generator draws between settles."""
    ours, theirs = np.random.default_rng(3), np.random.default_rng(3)
    for run in range(3):
        integers, random, bounded, settle, _ = pg._words(ours)
        angle = bounded(-180, 180)
        for i in range(2 * pg._WORDS_BLOCK + run):
            low, high = [(0, 1), (0, 2), (-180, 180), (0, 360), (0, 3), (0, 99991)][i % 6]
            assert integers(low, high) == int(theirs.integers(low, high))
            if i % 4 == run:
                assert angle() == int(theirs.integers(-180, 180))
            if i % 3:
                assert random() == theirs.random()
        settle()
        assert ours.bit_generator.state == theirs.bit_generator.state
        assert int(ours.integers(0, 7)) == int(theirs.integers(0, 7))  # the generator goes on from there
    assert pg._draws_match(pg._words, np.random.PCG64)  # else generation takes the direct C calls: right, only slower


def test_the_tape_lends_the_next_words_and_takes_back_where_they_were_spent():
    """Compiled code draws from the tape's words: lend(n) gives at least n unspent words (drawing blocks as needed)
    and the 32-bit half; spent(...) leaves the Python draws, and settle(), where that code left the stream."""
    ours, theirs = np.random.default_rng(5), np.random.default_rng(5)
    integers, random, _, settle, tape = pg._words(ours)
    for i in range(3):
        assert integers(0, 7) == int(theirs.integers(0, 7)) and random() == theirs.random()
        words, index, has, half = tape.lend(3 * pg._WORDS_BLOCK + i)
        assert len(words) - index >= 3 * pg._WORDS_BLOCK + i and words.dtype == np.uint64
        state = theirs.bit_generator.state
        assert (has, half) == (state["has_uint32"], state["uinteger"])
        assert np.array_equal(words[index:index + 9], theirs.bit_generator.random_raw(9))  # 9 spent elsewhere
        tape.spent(index + 9, 0, 0)
        state = theirs.bit_generator.state
        state["has_uint32"] = state["uinteger"] = 0
        theirs.bit_generator.state = state
    assert integers(-180, 180) == int(theirs.integers(-180, 180))
    settle()
    assert ours.bit_generator.state == theirs.bit_generator.state


@pytest.mark.skipif(not pathfinder_jit.available(), reason="numba is not installed: Python runs every attempt")
def test_compiled_attempts_draw_the_python_images(monkeypatch):
    """The compiled target-pair attempts against Python's: the same images, labels and stream, at every resolution,
    with most pairs fitted by compiled attempts and some attempts handed back to Python."""
    ends = []
    attempts = pathfinder_jit.Mirror.attempts
    monkeypatch.setattr(pathfinder_jit.Mirror, "attempts", lambda *a: ends.append(attempts(*a)) or ends[-1])
    for res, difficulty, seed, n in ((32, "hard", 21, 60), (32, "easy", 22, 30), (32, "intermediate", 23, 20),
                                     (64, "hard", 24, 6), (128, "hard", 25, 6)):
        params, rngs, digests = pg.PathfinderParams.for_lra(res, difficulty), [], []
        for compiled in (False, True):
            monkeypatch.setattr(pg, "_COMPILED", compiled)
            rngs.append(pg.batch_rng(seed, 0))
            digest = hashlib.sha256()
            for _ in range(n):
                img, label, margin, info = pg._render(params, rngs[-1])
                digest.update(img.tobytes() + bytes([label, margin]) + repr(info["markers"]).encode())
            digests.append(digest.hexdigest())
        assert digests[0] == digests[1] and rngs[0].bit_generator.state == rngs[1].bit_generator.state
    whys = [why for why, _ in ends]
    assert whys.count(pathfinder_jit.OK) > 100 and whys.count(pathfinder_jit.PYTHON) > 10


@pytest.mark.skipif(not pathfinder_jit.available(), reason="numba is not installed: Python runs every attempt")
def test_a_numba_that_cannot_compile_the_attempts_leaves_them_to_python(monkeypatch):
    """Where compiling fails (another numba's typing), one warning, and Python draws the same images from there."""
    import numba

    def fails(*args):
        raise numba.core.errors.TypingError("cannot type this")

    case = (32, "hard", 7, 100)
    monkeypatch.setattr(pathfinder_jit, "_attempts", fails)
    monkeypatch.setattr(pathfinder_jit, "_failure", None)
    with pytest.warns(UserWarning, match="cannot compile the target-pair attempts"):
        assert _digest(*case) == SAME_AS_V2[case]
    assert not pathfinder_jit.available()


@pytest.mark.skipif(not pathfinder_jit.available(), reason="numba is not installed: Python runs every attempt")
def test_without_a_cache_folder_the_attempts_compile_uncached(monkeypatch):
    """numba refuses cache=True where no folder is writable: the functions are compiled without a cache then."""
    import numba

    real, asked = numba.njit, []

    def njit(*args, cache=False, **kwargs):
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function: no locator available for file")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)
    plus_one = pathfinder_jit._jit(lambda x: x + 1)
    assert plus_one(41) == 42 and hasattr(plus_one, "py_func") and asked[:2] == [True, False]  # compiled, uncached


def test_marker_windows_are_the_canvas_markers():
    for res, step in ((32, 1), (128, 9)):
        params = pg.PathfinderParams.for_lra(res, "hard")
        scene = pg._Scene(params, None, params.paddle_margin_list[0])
        points = [(y, x) for y in [*range(0, res, step), res - 1] for x in [*range(0, res, step), res - 2]]
        assert all(np.array_equal(scene.marker(at), scene.marker_fast(at)) for at in points)


def test_padded_dilation_is_the_dilation():
    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(3, 70, 2))
        hit = rng.random((h, w)) < rng.random() * 0.3
        offsets = pg._seed_kernel(int(rng.integers(-180, 180)) * math.pi / 180, int(rng.integers(2, 6)), 1.5,
                                  int(rng.integers(1, 4)), 2)
        assert np.array_equal(pg._blocked(hit, offsets), pg._blocked_flat(hit, offsets))


def test_timing_rows(tmp_path):
    """``python -m lra.generate pathfinder --time CSV``: one row per algorithm; their ratio is the speedup."""
    from lra import generate  # the command brings lra.report's row writer

    out = tmp_path / "generate.csv"
    generate.main(["pathfinder", "--resolution", "32", "--difficulty", "easy", "--time", str(out), "--time-images",
                   "4", "--warmup", "2", "--time-runs", "2"])
    table = pd.read_csv(out)
    named = pg.GENERATORS if pathfinder_jit.available() else pg.GENERATORS[:2]
    assert list(table.columns) == pg.TIMING_COLUMNS and tuple(table.generator) == named
    canvas, *others = table.to_dict("records")
    assert canvas["generator"] == "canvas" and canvas["task"] == "pathfinder32" and canvas["speedup"] == 1
    for row in others:
        assert canvas["version"] == row["version"] == pg.GENERATOR_VERSION
        assert row["speedup"] == pytest.approx(canvas["s_per_image"] / row["s_per_image"], rel=0.05, abs=0.02)
        assert row["minutes_200k_16_cores"] == pytest.approx(row["s_per_image"] * 200_000 / 16 / 60, abs=0.1)
        assert (row["images"], row["runs"]) == (4, 2) and row["git_sha"]


def test_parallel_timing_row_is_the_wall_time_of_writing_the_images(tmp_path, monkeypatch):
    """``--time CSV --time-workers W``: ``generate`` itself, W processes, into a temporary folder it removes; the row
    says the workers, the wall time per image and LRA's 200,000 at that rate."""
    from lra import generate

    folders = []
    real = pg.generate
    monkeypatch.setattr(pg, "generate", lambda out, *a, **k: folders.append(real(out, *a, **k)) or folders[-1])
    out = tmp_path / "generate.csv"
    generate.main(["pathfinder", "--resolution", "32", "--difficulty", "easy", "--time", str(out), "--time-images",
                   "12", "--time-workers", "2"])
    row = pd.read_csv(out).iloc[-1]
    assert list(pd.read_csv(out).columns) == pg.TIMING_COLUMNS
    assert (row.task, row.generator, row.workers, row.images) == ("pathfinder32", pg._generator_name(), 2, 12)
    assert row.minutes_200k_wall == pytest.approx(row.s_per_image * 200_000 / 60, abs=0.1) and row.git_sha
    assert len(folders) == 1 and not folders[0].exists() and row.s_per_image > 0  # written, then removed


@pytest.mark.slow
def test_paddle_lists_outpace_the_canvas_code():
    """Ratios on one core of this machine (the committed figures are in results/generate.csv)."""
    path_x = pg.time_generators(128, "hard", images=10, warmup=60)
    assert path_x[1]["speedup"] > 5 and (len(path_x) == 2 or path_x[2]["speedup"] > 2 * path_x[1]["speedup"])
    assert pg.time_generators(32, "hard", images=200, warmup=200)[1]["speedup"] > 3


def test_seed_records_are_seed_info():
    """Each seed angle's kernel usability and first-target pixels, from the padded dilation, are _seed_info's."""
    for res, angles in ((32, range(-180, 180)), (128, range(-180, 180, 13))):
        params = pg.PathfinderParams.for_lra(res, "hard")
        for margin in params.paddle_margin_list:
            geometry = pg._pair_geometry(params, margin)
            for deg in angles:
                record, (_, usable, free) = geometry.seed_angle(deg), pg._seed_info(params, margin, geometry.deg[deg])
                assert (record.kernel is not None) == usable
                assert record.free == (None if not usable or free is None else (free[0].tolist(), free[1].tolist()))
