// What the prompt cache and the llama engine read from a llama-server (src/serve/llama_http.hpp) is
// bounded while it is read: a reply over the bound stops the read and is an error, never a body
// held whole first; a reply within it comes back byte for byte; a non-200 status and a reply that
// is not JSON are errors that say so. Against a local HTTP server of the test's own (127.0.0.1, a
// free port), built only where cpp-httplib is installed.
#include <gtest/gtest.h>

#if defined(VQ_HAVE_HTTPLIB)
#include <chrono>
#include <string>
#include <thread>

#include "../../src/serve/llama_http.hpp"
#include "veloxquant/core/error.hpp"

namespace {

class LocalServer {
 public:
  LocalServer() {
    big_.assign(3 << 20, 'x');
    server_.Get("/big", [this](const httplib::Request&, httplib::Response& res) { res.set_content(big_, "text/plain"); });
    server_.Post("/big", [this](const httplib::Request&, httplib::Response& res) { res.set_content(big_, "application/json"); });
    server_.Post("/json", [](const httplib::Request& req, httplib::Response& res) { res.set_content("{\"got\":" + req.body + "}", "application/json"); });
    server_.Post("/notjson", [](const httplib::Request&, httplib::Response& res) { res.set_content("{not json", "application/json"); });
    server_.Post("/err", [](const httplib::Request&, httplib::Response& res) {
      res.status = 500;
      res.set_content("model not loaded", "text/plain");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~LocalServer() {
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  const std::string& big() const { return big_; }

 private:
  httplib::Server server_;
  std::string big_;
  int port_ = 0;
  std::thread thread_;
};

httplib::Request get(const char* path) {
  httplib::Request r;
  r.method = "GET";
  r.path = path;
  return r;
}

}  // namespace

TEST(LlamaHttp, AReplyOverTheBoundIsStoppedNotHeldWhole) {
  LocalServer s;
  httplib::Client c("127.0.0.1", s.port());
  const auto over = vq::serve_detail::send_bounded(c, get("/big"), 1 << 20);
  EXPECT_TRUE(over.over_limit);
  EXPECT_NE(over.error, httplib::Error::Success);
  EXPECT_LE(over.body.size(), std::size_t{1} << 20);
  const auto within = vq::serve_detail::send_bounded(c, get("/big"), 4 << 20);
  EXPECT_FALSE(within.over_limit);
  EXPECT_EQ(within.error, httplib::Error::Success);
  EXPECT_EQ(within.status, 200);
  EXPECT_EQ(within.body, s.big());
  try {
    (void)vq::serve_detail::post_json(c, "test", "/big", nlohmann::json::object(), 1 << 20);
    ADD_FAILURE() << "a reply over the bound was accepted";
  } catch (const vq::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("reply over 1048576 bytes"), std::string::npos) << e.what();
  }
}

TEST(LlamaHttp, PostJsonGivesTheReplyOrSaysWhatWasWrong) {
  LocalServer s;
  httplib::Client c("127.0.0.1", s.port());
  EXPECT_EQ(vq::serve_detail::post_json(c, "test", "/json", {{"a", 1}}), nlohmann::json::parse(R"({"got":{"a":1}})"));
  EXPECT_THROW((void)vq::serve_detail::post_json(c, "test", "/notjson", nlohmann::json::object()), vq::FormatError);
  try {
    (void)vq::serve_detail::post_json(c, "test", "/err", nlohmann::json::object());
    ADD_FAILURE() << "a 500 was accepted";
  } catch (const vq::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("answered 500: model not loaded"), std::string::npos) << e.what();
  }
  httplib::Client nobody("127.0.0.1", 1);  // nothing listens on port 1
  nobody.set_connection_timeout(1, 0);
  EXPECT_THROW((void)vq::serve_detail::post_json(nobody, "test", "/json", nlohmann::json::object()), vq::IoError);
}
#endif
