// GGUF records of quant_linear_a8.cpp's VNNI kernel: the helpers its super-block records
// (K-quants' two-level scales) and 5- and 6-bit codes (int4 nibbles plus bit planes) need, and
// expand_codes, the 8-bit copy a tile of many rows of int4, 5- or 6-bit codes runs on. Included by quant_linear_a8.cpp
// inside its anonymous namespace, after A8Args and load16; layouts in that file's header.
#pragma once

// 16 int8 at p, as float32.
inline __m512 load16_i8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// -v exactly (the sign bit flipped: -(+0) is -0, as numpy's negation gives).
inline __m512 negate(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

inline __mmask64 load_mask(const uint8_t* p) {
  uint64_t m;
  std::memcpy(&m, p, 8);
  return _cvtu64_mask64(m);
}

// Vectors v0..v0 + nv of int4, 5- or 6-bit records copied into buf with 8-bit codes (u
// unchanged: the same sums, so the same output bits as in place)
// and, from super-block records, per-group float32 scales and zeros (d * sc, -(dmin * m): the
// values the kernel computes from them, so the outputs are the same bits); returns the copy's
// arguments (kExpandRows: from how many rows a8_run takes this copy, once per tile for all
// its rows). The copy is written to L2 and read back, which costs about what streaming 8-bit
// records from memory costs, so fewer rows unpack in place.
A8Args expand_codes(const A8Args& a, int64_t v0, int64_t nv, std::vector<uint8_t>& buf) {
  const int64_t nb = a.k / 32, src_records = nb / a.blocks_per_record;
  const int halves = a.group == 16 ? 2 : 1;
  A8Args e = a;
  e.planes = 0;
  e.table = nullptr;  // the copy holds u itself
  e.block_bytes = 512;
  e.vec_base = v0;
  e.prefetch = false;  // the copy is written here, so it is in L2 when read
  if (a.supers) {  // one record per block: its groups' float32 scales (and zeros)
    e.supers = e.half_scales = false;
    e.blocks_per_record = 1;
    e.scale_bytes = 16 * halves * 4;
    e.header = e.scale_bytes * (a.zeros ? 2 : 1);
  }
  e.record = e.header + e.blocks_per_record * 512;
  const int64_t dst_vector = nb / e.blocks_per_record * e.record;
  buf.resize(nv * dst_vector);
  e.packed = buf.data();
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i table = load_table(a.table);
  for (int64_t v = 0; v < nv; ++v) {
    const uint8_t* src = a.packed + (v0 + v - a.vec_base) * src_records * a.record;
    uint8_t* dst = buf.data() + v * dst_vector;
    int64_t rec = 0, in = 0;  // kb's source record and its block in it (no divisions)
    for (int64_t kb = 0; kb < nb; ++kb) {
      const uint8_t* hdr = src + rec * a.record;
      // the copy's record: one per block from super-blocks, else the source's own
      uint8_t* out = dst + (a.supers ? kb : rec) * e.record;
      if (a.supers) {
        auto* f = reinterpret_cast<float*>(out);
        for (int h = 0; h < halves; ++h) {
          const int64_t gi = halves == 2 ? 2 * in + h : in;
          const __m512 sc = _mm512_mul_ps(load16(true, hdr), load16_i8(hdr + a.sc_at + gi * 16));
          _mm512_storeu_ps(f + h * 16, sc);
          if (a.zeros) {
            _mm512_storeu_ps(f + (halves + h) * 16,
                             negate(_mm512_mul_ps(load16(true, hdr + 32),
                                                  load16_i8(hdr + a.m_at + gi * 16))));
          }
        }
      } else if (in == 0) {
        std::memcpy(out, hdr, a.header);
      }
      const uint8_t* p = hdr + a.header + in * a.block_bytes;
      uint8_t* q = out + e.header + (a.supers ? 0 : in) * 512;
      for (int t = 0; t < 4; ++t) {
        const __m512i packed = _mm512_loadu_si512(p + t * 64);
        __m512i lo, hi;
        if (a.table != nullptr) {  // table codes (no planes then)
          table_halves(table, packed, lo, hi);
        } else {
          lo = _mm512_and_si512(packed, low4);
          hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        }
        for (int64_t pl = 0; pl < a.planes; ++pl) {
          const uint8_t* bits = p + 256 + pl * 64;
          const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << pl));
          lo = _mm512_mask_add_epi8(lo, load_mask(bits + t * 8), lo, add);
          hi = _mm512_mask_add_epi8(hi, load_mask(bits + (t + 4) * 8), hi, add);
        }
        _mm512_storeu_si512(q + t * 64, lo);
        _mm512_storeu_si512(q + (t + 4) * 64, hi);
      }
      if (++in == a.blocks_per_record) {
        in = 0;
        ++rec;
      }
    }
  }
  return e;
}
