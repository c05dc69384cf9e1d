// The CPU reference (src/reference/*.hpp) and its seeded test data, for the Python tests and tools: the same
// oracle the C++ tests use. Host vectors travel as flat numpy arrays (BF16 as uint16 bits);
// epx_tools.reference reshapes.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cctype>
#include <memory>
#include <string>
#include <vector>

#include "binding.hpp"
#include "epx/error.hpp"
#include "formats/scale_format.hpp"
#include "reference/internode.hpp"
#include "reference/layout.hpp"
#include "reference/low_latency.hpp"
#include "reference/normal.hpp"
#include "reference/test_data.hpp"

namespace epx::python {

namespace {

namespace ref = epx::reference;

template <typename T>
using InArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> to_vector(const InArray<T>& array) {
  return std::vector<T>(array.data(), array.data() + array.size());
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& values) {
  py::array_t<T> array(static_cast<py::ssize_t>(values.size()));
  std::copy(values.begin(), values.end(), array.mutable_data());
  return array;
}

// A std::vector field as a numpy property (a copy each way).
template <typename Class, typename T>
void def_vector(py::class_<Class>& cls, const char* name, std::vector<T> Class::*member) {
  cls.def_property(
      name, [member](const Class& self) { return to_array(self.*member); },
      [member](Class& self, const InArray<T>& array) { self.*member = to_vector(array); });
}

// Class(**fields): default-construct, then set each keyword as an attribute (unknown names raise).
template <typename Class>
void def_kwargs_init(py::class_<Class>& cls) {
  cls.def(py::init([](const py::kwargs& fields) {
    auto value = std::make_unique<Class>();
    py::object view = py::cast(value.get(), py::return_value_policy::reference);
    for (const auto& item : fields) py::setattr(view, item.first, item.second);
    return value;
  }));
}

void bind_layout(py::module_& m) {
  py::class_<ref::DispatchLayout> layout(m, "DispatchLayout");
  layout.def_readonly("num_tokens", &ref::DispatchLayout::num_tokens)
      .def_readonly("num_ranks", &ref::DispatchLayout::num_ranks)
      .def_readonly("num_experts", &ref::DispatchLayout::num_experts);
  def_vector(layout, "num_tokens_per_rank", &ref::DispatchLayout::num_tokens_per_rank);
  def_vector(layout, "num_tokens_per_expert", &ref::DispatchLayout::num_tokens_per_expert);
  def_vector(layout, "is_token_in_rank", &ref::DispatchLayout::is_token_in_rank);
  def_vector(layout, "num_tokens_per_rdma_rank", &ref::DispatchLayout::num_tokens_per_rdma_rank);
  m.def(
      "get_dispatch_layout",
      [](const InArray<int64_t>& topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
         int ranks_per_node) {
        EPX_CHECK(static_cast<size_t>(topk_idx.size()) == size_t(num_tokens) * num_topk, "topk_idx size",
                  topk_idx.size(), "must be num_tokens * num_topk");
        return ref::get_dispatch_layout(topk_idx.data(), num_tokens, num_topk, num_experts, num_ranks,
                                        ranks_per_node);
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
      py::arg("num_ranks"), py::arg("ranks_per_node") = 0);
  m.def(
      "check_topk_idx",
      [](const InArray<int64_t>& topk_idx, int num_tokens, int num_topk, int num_experts) {
        EPX_CHECK(static_cast<size_t>(topk_idx.size()) == size_t(num_tokens) * num_topk, "topk_idx size",
                  topk_idx.size(), "must be num_tokens * num_topk");
        ref::check_topk_idx(topk_idx.data(), num_tokens, num_topk, num_experts);
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"));
}

void bind_normal(py::module_& m) {
  // Every scale format, named after its traits (BF16, FP8, FP8_POW2, FP8_UE8M0, ...).
  py::enum_<ref::PayloadFormat> payload_format(m, "PayloadFormat");
  for_each_scale_format([&](ScaleFormat format) {
    std::string name = scale_format_name(format);
    for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    payload_format.value(name.c_str(), format);
  });

  py::class_<ref::NormalDispatchParams> params(m, "NormalDispatchParams");
  def_kwargs_init(params);
  params.def_readwrite("num_ranks", &ref::NormalDispatchParams::num_ranks)
      .def_readwrite("num_experts", &ref::NormalDispatchParams::num_experts)
      .def_readwrite("hidden", &ref::NormalDispatchParams::hidden)
      .def_readwrite("format", &ref::NormalDispatchParams::format)
      .def_readwrite("with_topk", &ref::NormalDispatchParams::with_topk)
      .def_readwrite("num_topk", &ref::NormalDispatchParams::num_topk)
      .def_readwrite("expert_alignment", &ref::NormalDispatchParams::expert_alignment)
      .def_readwrite("num_worst_tokens", &ref::NormalDispatchParams::num_worst_tokens);

  using In = ref::NormalDispatchRankInput;
  py::class_<In> in(m, "NormalDispatchRankInput");
  def_kwargs_init(in);
  in.def_readwrite("num_tokens", &In::num_tokens);
  def_vector(in, "x", &In::x);
  def_vector(in, "x_fp8", &In::x_fp8);
  def_vector(in, "x_scales", &In::x_scales);
  def_vector(in, "topk_idx", &In::topk_idx);
  def_vector(in, "topk_weights", &In::topk_weights);
  def_vector(in, "is_token_in_rank", &In::is_token_in_rank);
  def_vector(in, "num_tokens_per_expert", &In::num_tokens_per_expert);

  using Out = ref::NormalDispatchRankOutput;
  py::class_<Out> out(m, "NormalDispatchRankOutput");
  out.def_readonly("num_recv_tokens", &Out::num_recv_tokens).def_readonly("num_rows", &Out::num_rows);
  def_vector(out, "recv_x", &Out::recv_x);
  def_vector(out, "recv_x_fp8", &Out::recv_x_fp8);
  def_vector(out, "recv_x_scales", &Out::recv_x_scales);
  def_vector(out, "recv_topk_idx", &Out::recv_topk_idx);
  def_vector(out, "recv_topk_weights", &Out::recv_topk_weights);
  def_vector(out, "num_recv_tokens_per_expert_list", &Out::num_recv_tokens_per_expert_list);
  def_vector(out, "recv_src_rank", &Out::recv_src_rank);
  def_vector(out, "recv_src_token_idx", &Out::recv_src_token_idx);
  def_vector(out, "num_recv_tokens_per_rank", &Out::num_recv_tokens_per_rank);
  def_vector(out, "recv_rank_prefix", &Out::recv_rank_prefix);

  py::class_<ref::NormalHandle>(m, "NormalHandle")
      .def_readonly("num_ranks", &ref::NormalHandle::num_ranks)
      .def_readonly("hidden", &ref::NormalHandle::hidden)
      .def_readonly("num_tokens", &ref::NormalHandle::num_tokens)
      .def_readonly("num_rows", &ref::NormalHandle::num_rows)
      .def_readonly("recv_row", &ref::NormalHandle::recv_row);
  py::class_<ref::NormalDispatchResult>(m, "NormalDispatchResult")
      .def_readonly("ranks", &ref::NormalDispatchResult::ranks)
      .def_readonly("handle", &ref::NormalDispatchResult::handle);
  m.def("normal_dispatch", &ref::normal_dispatch, py::arg("params"), py::arg("inputs"));

  py::class_<ref::NormalCombineParams> combine_params(m, "NormalCombineParams");
  def_kwargs_init(combine_params);
  combine_params.def_readwrite("num_topk", &ref::NormalCombineParams::num_topk)
      .def_readwrite("num_biases", &ref::NormalCombineParams::num_biases);

  using CIn = ref::NormalCombineRankInput;
  py::class_<CIn> combine_in(m, "NormalCombineRankInput");
  def_kwargs_init(combine_in);
  def_vector(combine_in, "x", &CIn::x);
  def_vector(combine_in, "topk_weights", &CIn::topk_weights);
  def_vector(combine_in, "bias0", &CIn::bias0);
  def_vector(combine_in, "bias1", &CIn::bias1);

  using COut = ref::NormalCombineRankOutput;
  py::class_<COut> combine_out(m, "NormalCombineRankOutput");
  def_vector(combine_out, "combined_x", &COut::combined_x);
  def_vector(combine_out, "combined_topk_weights", &COut::combined_topk_weights);
  m.def("normal_combine", &ref::normal_combine, py::arg("handle"), py::arg("params"), py::arg("inputs"));
  m.def("internode_combine", &ref::internode_combine, py::arg("handle"), py::arg("ranks_per_node"),
        py::arg("params"), py::arg("inputs"));
}

void bind_low_latency(py::module_& m) {
  py::class_<ref::LowLatencyParams> params(m, "LowLatencyParams");
  def_kwargs_init(params);
  params.def_readwrite("num_ranks", &ref::LowLatencyParams::num_ranks)
      .def_readwrite("num_experts", &ref::LowLatencyParams::num_experts)
      .def_readwrite("hidden", &ref::LowLatencyParams::hidden)
      .def_readwrite("num_topk", &ref::LowLatencyParams::num_topk)
      .def_readwrite("num_max_dispatch_tokens_per_rank",
                     &ref::LowLatencyParams::num_max_dispatch_tokens_per_rank)
      .def_readwrite("masked_ranks", &ref::LowLatencyParams::masked_ranks);  // a list (a copy)

  py::class_<ref::LowLatencyDispatchOptions> options(m, "LowLatencyDispatchOptions");
  def_kwargs_init(options);
  for (const auto& [name, flag] : kLowLatencyFormatFlagNames) options.def_readwrite(name, flag);

  using In = ref::LowLatencyDispatchRankInput;
  py::class_<In> in(m, "LowLatencyDispatchRankInput");
  def_kwargs_init(in);
  in.def_readwrite("num_tokens", &In::num_tokens);
  def_vector(in, "x", &In::x);
  def_vector(in, "topk_idx", &In::topk_idx);

  using Out = ref::LowLatencyDispatchRankOutput;
  py::class_<Out> out(m, "LowLatencyDispatchRankOutput");
  def_vector(out, "recv_x", &Out::recv_x);
  def_vector(out, "recv_x_fp8", &Out::recv_x_fp8);
  def_vector(out, "recv_x_scales", &Out::recv_x_scales);
  def_vector(out, "recv_x_scales_ue8m0", &Out::recv_x_scales_ue8m0);
  def_vector(out, "recv_count", &Out::recv_count);
  def_vector(out, "recv_src_begin", &Out::recv_src_begin);
  def_vector(out, "recv_src_count", &Out::recv_src_count);
  def_vector(out, "recv_src_rank", &Out::recv_src_rank);
  def_vector(out, "recv_src_token_idx", &Out::recv_src_token_idx);

  m.def("ll_num_ue8m0_words", &ref::ll_num_ue8m0_words, py::arg("hidden"));
  m.def("ll_num_rows_per_expert", &ref::ll_num_rows_per_expert, py::arg("params"));
  // cumulative_local_expert_recv_stats: optional [R] int32 arrays of [L], updated in place.
  m.def(
      "low_latency_dispatch",
      [](const ref::LowLatencyParams& p, const ref::LowLatencyDispatchOptions& o,
         const std::vector<In>& inputs, std::optional<std::vector<py::array_t<int>>> stats) {
        if (!stats) return ref::low_latency_dispatch(p, o, inputs);
        std::vector<std::vector<int>> values;
        for (const auto& array : *stats) values.emplace_back(array.data(), array.data() + array.size());
        auto outputs = ref::low_latency_dispatch(p, o, inputs, &values);
        for (size_t r = 0; r < values.size() && r < stats->size(); ++r) {
          auto& array = (*stats)[r];
          EPX_CHECK(static_cast<size_t>(array.size()) == values[r].size(), "stats size", array.size(),
                    "must be num_local_experts");
          std::copy(values[r].begin(), values[r].end(), array.mutable_data());
        }
        return outputs;
      },
      py::arg("params"), py::arg("options"), py::arg("inputs"),
      py::arg("cumulative_local_expert_recv_stats") = py::none());
  m.def(
      "low_latency_recv_rows",
      [](const ref::LowLatencyParams& p, const std::vector<InArray<int64_t>>& topk_idx,
         const std::vector<int>& num_tokens) {
        std::vector<const int64_t*> pointers;
        for (const auto& array : topk_idx) pointers.push_back(array.data());
        return ref::low_latency_recv_rows(p, pointers, num_tokens);
      },
      py::arg("params"), py::arg("topk_idx_per_rank"), py::arg("num_tokens_per_rank"));

  py::class_<ref::LowLatencyCombineOptions> combine_options(m, "LowLatencyCombineOptions");
  def_kwargs_init(combine_options);
  combine_options.def_readwrite("use_logfmt", &ref::LowLatencyCombineOptions::use_logfmt);
  combine_options.def_readwrite("pre_reduce", &ref::LowLatencyCombineOptions::pre_reduce);
  combine_options.def_readwrite("logfmt_within_node", &ref::LowLatencyCombineOptions::logfmt_within_node);
  combine_options.def_readwrite("ranks_per_node", &ref::LowLatencyCombineOptions::ranks_per_node);

  using CIn = ref::LowLatencyCombineRankInput;
  py::class_<CIn> combine_in(m, "LowLatencyCombineRankInput");
  def_kwargs_init(combine_in);
  combine_in.def_readwrite("num_tokens", &CIn::num_tokens);
  def_vector(combine_in, "x", &CIn::x);
  def_vector(combine_in, "topk_idx", &CIn::topk_idx);
  def_vector(combine_in, "topk_weights", &CIn::topk_weights);

  using COut = ref::LowLatencyCombineRankOutput;
  py::class_<COut> combine_out(m, "LowLatencyCombineRankOutput");
  def_vector(combine_out, "combined_x", &COut::combined_x);
  m.def("low_latency_combine", &ref::low_latency_combine, py::arg("params"), py::arg("options"),
        py::arg("inputs"));
}

void bind_test_data(py::module_& m) {
  py::enum_<ref::TokenValues>(m, "TokenValues")
      .value("SMALL_INTEGERS", ref::TokenValues::kSmallIntegers)
      .value("UNIFORM", ref::TokenValues::kUniform);
  m.attr("STAMP_CHANNELS") = ref::kStampChannels;

  py::class_<ref::RoutingSpec> spec(m, "RoutingSpec");
  def_kwargs_init(spec);
  spec.def_readwrite("num_tokens", &ref::RoutingSpec::num_tokens)
      .def_readwrite("num_topk", &ref::RoutingSpec::num_topk)
      .def_readwrite("num_experts", &ref::RoutingSpec::num_experts)
      .def_readwrite("num_ranks", &ref::RoutingSpec::num_ranks)
      .def_readwrite("hot_experts", &ref::RoutingSpec::hot_experts)
      .def_readwrite("hot_probability", &ref::RoutingSpec::hot_probability)
      .def_readwrite("excluded_experts", &ref::RoutingSpec::excluded_experts)
      .def_readwrite("excluded_ranks", &ref::RoutingSpec::excluded_ranks)
      .def_readwrite("drop_probability", &ref::RoutingSpec::drop_probability);

  m.def(
      "random_topk_idx",
      [](uint64_t seed, int num_tokens, int num_topk, int num_experts) {
        return to_array(ref::random_topk_idx(seed, num_tokens, num_topk, num_experts));
      },
      py::arg("seed"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"));
  m.def(
      "make_topk_idx",
      [](const ref::RoutingSpec& s, uint64_t seed) { return to_array(ref::make_topk_idx(s, seed)); },
      py::arg("spec"), py::arg("seed"));
  m.def(
      "make_unbalanced_routing",
      [](uint64_t seed, const std::vector<int>& num_tokens, int num_topk, int num_experts, int num_ranks) {
        py::list per_rank;
        for (const auto& ids :
             ref::make_unbalanced_routing(seed, num_tokens, num_topk, num_experts, num_ranks))
          per_rank.append(to_array(ids));
        return per_rank;
      },
      py::arg("seed"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
      py::arg("num_ranks"));
  m.def(
      "random_topk_weights",
      [](uint64_t seed, int num_tokens, int num_topk) {
        return to_array(ref::random_topk_weights(seed, num_tokens, num_topk));
      },
      py::arg("seed"), py::arg("num_tokens"), py::arg("num_topk"));
  m.def(
      "random_bf16_tokens",
      [](uint64_t seed, int num_tokens, int hidden, int src_rank, ref::TokenValues values, bool stamp) {
        return to_array(ref::random_bf16_tokens(seed, num_tokens, hidden, src_rank, values, stamp));
      },
      py::arg("seed"), py::arg("num_tokens"), py::arg("hidden"), py::arg("src_rank"),
      py::arg("values") = ref::TokenValues::kSmallIntegers, py::arg("stamp") = true);
  m.def(
      "random_fp8_tokens",
      [](uint64_t seed, int num_tokens, int hidden, int src_rank, bool round_scale, bool stamp) {
        ref::Fp8Tokens tokens =
            ref::random_fp8_tokens(seed, num_tokens, hidden, src_rank, round_scale, stamp);
        return py::make_tuple(to_array(tokens.x), to_array(tokens.scales));
      },
      py::arg("seed"), py::arg("num_tokens"), py::arg("hidden"), py::arg("src_rank"),
      py::arg("round_scale") = false, py::arg("stamp") = true);
  m.def(
      "read_stamp",
      [](const InArray<uint16_t>& row) {
        const ref::Stamp stamp = ref::read_stamp(row.data(), static_cast<int>(row.size()));
        return py::make_tuple(stamp.src_rank, stamp.token_idx);
      },
      py::arg("row"), "(src_rank, token_idx) of a BF16 row, (-1, -1) when it carries no stamp.");
}

}  // namespace

void bind_reference(py::module_& m) {
  bind_layout(m);
  bind_normal(m);
  bind_low_latency(m);
  bind_test_data(m);
}

}  // namespace epx::python
