// The byte encoding of a rolled-out batch (trainer/produced.h, core/bytes.h): every field comes
// back equal, and a short, long or garbled buffer is an error naming the field and the offset.
#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/produced_fixture.h"

namespace kiln::trainer {
namespace {

TEST(Produced, EveryFieldRoundTrips) {
  const ProducedBatch p = test::produced_fixture(3);
  ByteWriter w;
  write_produced(w, p);
  ByteReader r(w.bytes().data(), w.bytes().size(), "the batch");
  const ProducedBatch q = read_produced(r);
  r.expect_end();
  test::expect_same_produced(p, q);
  // An empty batch too.
  ByteWriter e;
  write_produced(e, ProducedBatch{});
  ByteReader er(e.bytes().data(), e.bytes().size(), "an empty batch");
  test::expect_same_produced(ProducedBatch{}, read_produced(er));
  er.expect_end();
}

TEST(Produced, BadBuffersNameTheFieldAndOffset) {
  ByteWriter w;
  write_produced(w, test::produced_fixture(1));
  const std::vector<uint8_t>& b = w.bytes();
  // Cut short: the read that runs out names what it was reading and where.
  ByteReader cut(b.data(), b.size() - 5, "the batch from rank 1");
  EXPECT_TRUE(test::throws_with([&] { read_produced(cut); }, {"the batch from rank 1", "offset", "left", "truncated"}));
  // Bytes left over: the writer and the reader disagree.
  std::vector<uint8_t> longer = b;
  longer.push_back(0);
  ByteReader more(longer.data(), longer.size(), "the batch");
  read_produced(more);
  EXPECT_TRUE(test::throws_with([&] { more.expect_end(); }, {"the batch", "1 bytes past what was read"}));
  // A count larger than the buffer (the first field is the number of prompts).
  std::vector<uint8_t> garbled = b;
  garbled[7] = 0x7f;
  ByteReader bad(garbled.data(), garbled.size(), "the batch");
  EXPECT_TRUE(test::throws_with([&] { read_produced(bad); }, {"the prompts", "offset 0", "does not fit"}));
}

TEST(Produced, TensorsKeepDtypeAndShape) {
  ByteWriter w;
  w.put_tensor(at::arange(12, at::kFloat).view({3, 4}).t());  // non-contiguous
  w.put_tensor(at::Tensor());
  w.put_tensor(at::zeros({0, 5}, at::kBFloat16));
  ByteReader r(w.bytes().data(), w.bytes().size(), "tensors");
  EXPECT_TRUE(at::equal(r.get_tensor("a"), at::arange(12, at::kFloat).view({3, 4}).t()));
  EXPECT_FALSE(r.get_tensor("b").defined());
  const at::Tensor e = r.get_tensor("c");
  EXPECT_EQ(e.scalar_type(), at::kBFloat16);
  EXPECT_EQ(e.sizes(), (std::vector<int64_t>{0, 5}));
  r.expect_end();
  // A dtype this encoding never writes, and a shape whose product would overflow after a zero.
  ByteWriter q;
  q.put(uint8_t(1));
  q.put(int32_t(at::ScalarType::QInt8));
  ByteReader rq(q.bytes().data(), q.bytes().size(), "a tensor");
  EXPECT_TRUE(test::throws_with([&] { rq.get_tensor("the routing"); }, {"the routing", "not a dtype"}));
  ByteWriter s;
  s.put(uint8_t(1));
  s.put(int32_t(at::kFloat));
  s.put(std::vector<int64_t>{0, int64_t(1) << 62, int64_t(1) << 62});
  ByteReader rs(s.bytes().data(), s.bytes().size(), "a tensor");
  EXPECT_TRUE(test::throws_with([&] { rs.get_tensor("the routing"); }, {"the routing", "does not fit"}));
}

}  // namespace
}  // namespace kiln::trainer
