// The score kinds of the mask and score kernels, mirroring pyprune.ops.conventions.ScoreKind
// (tests/ops/test_conventions.py parses this enum and checks it equals the Python one).
// Unscoped, so the values serve directly as int template arguments and switch labels.
#pragma once

namespace pyprune {

enum ScoreKind : int {
  GIVEN = 0,      // the input itself is the score
  MAGNITUDE = 1,  // |W|
  WANDA = 2,      // |W| * sqrt(act_sqnorm[col])
  TAYLOR = 3,     // |W * G| (first-order Taylor; Triton only)
};

}  // namespace pyprune
