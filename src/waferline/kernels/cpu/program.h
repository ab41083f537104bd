// A decode step's ops replayed from C++ (StepProgram).
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- a decode step's ops, replayed from C++
// DecoderModel's step plan (decoder.py, _StepPlan) keeps a step's whole-layer ops (mla_moe_layer, mamba_ffn_layer)
// and their arguments from one step to the next; this holds those arguments here, as the dispatcher's values, and
// runs the ops back to back, each through the dispatcher (callBoxed: what a Python call of the op reaches after its
// arguments are converted, so a dispatch mode, the profiler and the ops' own checks see every op as before), each
// op's first output going into the next one. A decode step's program may also begin with the embedding and end with
// the final norm, the LM head and the argmax (DecoderModel.step_logits). Per step only the per-step tensors (the
// tokens, the rotary rows, caches, slots, positions) come in from Python. It saves, per op, converting its Python
// arguments (~40 for a layer) and the Python between the ops (~15-25 us a layer on a 2-core CPU, where the second
// thread waits for it). The same ops on the same arguments: the same numbers.
struct StepProgram : torch::CustomClassHolder {
  struct Op {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;  // all its arguments; None where the running tensor and the per-step ones go
    std::vector<int64_t> dyn;       // where the per-step tensors go (ascending)
    int64_t xpos = 0, lead = 1;     // where the running tensor goes; how many outputs lead (the rest: its extras)
    bool keep_input = false;        // return its running input too (the final norm's: the hidden states)
  };
  std::vector<Op> ops;
  int64_t ndyn = 0;

  // op ``name`` ("waferline::mla_moe_layer", "aten::embedding"), its arguments (Python values, converted as the op's
  // schema types them), the per-step positions, the running tensor's position, its leading outputs, whether its
  // running input is returned too
  void add(const std::string& name, std::vector<c10::IValue> args, std::vector<int64_t> dyn, int64_t xpos,
           int64_t lead, bool keep_input) {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
    const auto& params = op.schema().arguments();
    const int64_t n = static_cast<int64_t>(args.size());
    TORCH_CHECK(args.size() == params.size(), "StepProgram.add: ", name, " takes ", params.size(), " arguments, got ",
                args.size());
    TORCH_CHECK(xpos >= 0 && xpos < n && lead >= 1, "StepProgram.add: bad running-tensor position or lead");
    for (size_t i = 0; i < dyn.size(); ++i)
      TORCH_CHECK(dyn[i] >= 0 && dyn[i] < n && dyn[i] != xpos && (i == 0 || dyn[i] > dyn[i - 1]),
                  "StepProgram.add: per-step positions must be ascending argument positions");
    for (int64_t i = 0; i < n; ++i) {
      if (i == xpos || std::find(dyn.begin(), dyn.end(), i) != dyn.end()) continue;
      const c10::TypePtr& want = params[i].type();
      if (want->kind() == c10::TypeKind::FloatType && args[i].isInt()) args[i] = static_cast<double>(args[i].toInt());
      TORCH_CHECK(args[i].type()->isSubtypeOf(*want), "StepProgram.add: ", name, " argument ", params[i].name(),
                  " wants ", want->repr_str(), ", got ", args[i].type()->repr_str());
    }
    ndyn += static_cast<int64_t>(dyn.size());
    ops.push_back({op, std::move(args), std::move(dyn), xpos, lead, keep_input});
  }

  // x through every op, the per-step tensors in op order -> [[the last op's first output, then the running inputs
  // kept]], followed, when any op returned outputs beyond its leading ones (a Mamba-2 verify's record), by each op's
  // list of those
  std::vector<std::vector<at::Tensor>> run(at::Tensor x, std::vector<at::Tensor> dyn) {
    TORCH_CHECK(static_cast<int64_t>(dyn.size()) == ndyn, "StepProgram.run: ", ndyn, " per-step tensors, got ",
                dyn.size());
    std::vector<std::vector<at::Tensor>> ret(1);
    bool extras = false;
    size_t d = 0;
    torch::jit::Stack stack;
    std::vector<at::Tensor> out, kept;
    for (const Op& o : ops) {
      if (o.keep_input) kept.push_back(x);
      stack.clear();
      stack.reserve(o.args.size());
      size_t k = 0;
      for (size_t i = 0; i < o.args.size(); ++i) {
        if (static_cast<int64_t>(i) == o.xpos) {
          stack.emplace_back(std::move(x));
        } else if (k < o.dyn.size() && o.dyn[k] == static_cast<int64_t>(i)) {
          stack.emplace_back(dyn[d++]);
          ++k;
        } else {
          stack.push_back(o.args[i]);
        }
      }
      o.op.callBoxed(stack);
      out.clear();  // ((Tensor, Tensor) leaves two values, Tensor[] one list)
      for (auto& v : stack) {
        if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorList()) out.push_back(t);
        } else {
          out.push_back(v.toTensor());
        }
      }
      TORCH_CHECK(static_cast<int64_t>(out.size()) >= o.lead, "StepProgram.run: ", o.op.schema().name(), " returned ",
                  out.size(), " tensors");
      x = std::move(out[0]);
      ret.emplace_back(out.begin() + o.lead, out.end());
      extras = extras || static_cast<int64_t>(out.size()) > o.lead;
    }
    if (!extras) ret.resize(1);
    ret[0].push_back(std::move(x));
    ret[0].insert(ret[0].end(), kept.begin(), kept.end());
    return ret;
  }
};

}  // namespace
